"""From recorded turns to training samples: reward modes, judge dispatch, PRM scoring, teacher scoring."""

"""The run report (``hindsight-report``): trainer metrics, stored samples and judge metrics as one HTML page.

``data`` reads the inputs and holds the pure summaries, ``svg`` draws charts, ``page`` assembles the
page, ``cli`` is the entry point. Nothing here imports torch.
"""

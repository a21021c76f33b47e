// Two turns through OpenClaw's own model runtime (@openclaw/ai, as installed with the openclaw CLI) against
// an OpenAI-compatible base URL: the first reply is whatever the server streams; the second request carries
// the history OpenClaw rebuilds from it. Prints the first reply's content blocks as JSON.
//   node openclaw_replay.mjs <@openclaw/ai dir> <base url> <tool result text or "">
const [aiDir, baseUrl, toolResult] = process.argv.slice(2);
const { createLlmRuntime, createApiRegistry } = await import(`${aiDir}/dist/index.mjs`);
const { registerBuiltInApiProviders } = await import(`${aiDir}/dist/providers.mjs`);
const registry = createApiRegistry();
registerBuiltInApiProviders(registry);
const runtime = createLlmRuntime(registry);
const model = {
  id: "hindsight-policy", name: "hindsight-policy", api: "openai-completions", provider: "hindsight",
  baseUrl, reasoning: true, input: ["text"], cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0 },
  contextWindow: 65536, maxTokens: 256,
};
const tools = [{
  name: "read", description: "Read a file",
  parameters: { type: "object", properties: { path: { type: "string" } }, required: ["path"] },
}];
const now = Date.now();
const context = { systemPrompt: "be brief", tools, messages: [{ role: "user", content: "hi", timestamp: now }] };
const first = await runtime.complete(model, context, { apiKey: "sk-test" });
if (first.errorMessage) throw new Error(first.errorMessage);
context.messages.push(first);
for (const block of first.content) {
  if (block.type === "toolCall") {
    context.messages.push({
      role: "toolResult", toolCallId: block.id, toolName: block.name, isError: false, timestamp: now,
      content: [{ type: "text", text: toolResult }],
    });
  }
}
if (!first.content.some((b) => b.type === "toolCall")) context.messages.push({ role: "user", content: "thanks", timestamp: now });
const second = await runtime.complete(model, context, { apiKey: "sk-test" });
if (second.errorMessage) throw new Error(second.errorMessage);
console.log(JSON.stringify(first.content));

// Turning a conversation into a request, and stream deltas into an assistant message.

/** The request body for `conversation` (its settings, its model, its messages so far). */
export function chatRequest(conversation) {
  const { settings } = conversation;
  const messages = [];
  if (settings.system && settings.system.trim()) messages.push({ role: 'system', content: settings.system });
  for (const message of conversation.messages) {
    if (message.role === 'assistant' && !message.content) continue; // a failed or empty reply
    messages.push({ role: message.role, content: message.content });
  }
  const body = { model: conversation.model, messages };
  for (const name of ['temperature', 'top_p', 'max_tokens']) {
    const value = Number(settings[name]);
    if (settings[name] !== '' && settings[name] != null && Number.isFinite(value)) body[name] = value;
  }
  return body;
}

/** A fresh assistant message that stream deltas are added to. */
export function emptyReply() {
  return { role: 'assistant', content: '', reasoning: '', toolCalls: [], toolResults: [], stats: null, error: null };
}

/**
 * Add one `choices[0].delta` to `reply`: `content`, reasoning (`reasoning_content` or `reasoning`),
 * `tool_calls` (pieces merged by their `index`) and MCP tool results (`tool_results`:
 * `[{tool_call_id, name, content}]`, shown under the call they answer).
 */
export function applyDelta(reply, delta) {
  if (typeof delta.content === 'string') reply.content += delta.content;
  const reasoning = delta.reasoning_content ?? delta.reasoning;
  if (typeof reasoning === 'string') reply.reasoning += reasoning;
  for (const piece of delta.tool_calls || []) {
    const index = piece.index ?? reply.toolCalls.length;
    const call = (reply.toolCalls[index] ||= { id: '', name: '', arguments: '' });
    if (piece.id) call.id = piece.id;
    if (piece.function?.name) call.name += piece.function.name;
    if (piece.function?.arguments) call.arguments += piece.function.arguments;
  }
  for (const result of delta.tool_results || []) {
    reply.toolResults.push({
      tool_call_id: result.tool_call_id || '',
      name: result.name || '',
      content: typeof result.content === 'string' ? result.content : JSON.stringify(result.content),
    });
  }
}

/** Pretty JSON when `text` parses, else `text` as it is. */
export function prettyJson(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

/** A conversation's title from its first user message. */
export function titleFrom(text) {
  const line = text.replace(/\s+/g, ' ').trim();
  return line.length > 48 ? `${line.slice(0, 45)}…` : line || 'New chat';
}

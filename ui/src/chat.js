// Turning a conversation into a request, and stream deltas into an assistant message.
import { imageParts } from './images.js';

/**
 * The request body for `conversation` (its settings, its model, its messages so far): a user
 * message with `images` is sent as content parts, its images (as `image_url` parts) before its
 * text. With `mcp`
 * (the server has MCP tools) it asks the server to run the model's MCP tool calls (`mcp_execute`).
 */
export function chatRequest(conversation, { mcp = false } = {}) {
  const { settings } = conversation;
  const messages = [];
  if (settings.system && settings.system.trim()) messages.push({ role: 'system', content: settings.system });
  for (const message of conversation.messages) {
    if (message.role === 'assistant' && !message.content) continue; // a failed or empty reply
    if (message.images && message.images.length) {
      const text = message.content ? [{ type: 'text', text: message.content }] : [];
      messages.push({ role: message.role, content: [...imageParts(message.images), ...text] });
    } else {
      messages.push({ role: message.role, content: message.content });
    }
  }
  const body = { model: conversation.model, messages };
  for (const name of ['temperature', 'top_p', 'max_tokens']) {
    const value = Number(settings[name]);
    if (settings[name] !== '' && settings[name] != null && Number.isFinite(value)) body[name] = value;
  }
  if (mcp) body.mcp_execute = true;
  return body;
}

/** A fresh assistant message that stream deltas are added to. */
export function emptyReply() {
  return { role: 'assistant', content: '', reasoning: '', toolCalls: [], mcpCalls: [], stats: null, error: null };
}

/**
 * Add one `choices[0].delta` to `reply`: `content`, reasoning (`reasoning_content` or `reasoning`),
 * `tool_calls` (pieces merged by their `index`: calls returned to the client) and `mcp_calls`
 * (`[{id, name, arguments, result, is_error}]`: the MCP calls the server ran between two rounds
 * with `mcp_execute`, each with its result). Each call keeps `at`, the length of the text before
 * it, so that it is shown where it happened. A whole non-streamed `message` has the same fields
 * (its `tool_calls` without `index`) and can be added the same way.
 */
export function applyDelta(reply, delta) {
  if (typeof delta.content === 'string') reply.content += delta.content;
  const reasoning = delta.reasoning_content ?? delta.reasoning;
  if (typeof reasoning === 'string') reply.reasoning += reasoning;
  for (const piece of delta.tool_calls || []) {
    const index = piece.index ?? reply.toolCalls.length;
    const call = (reply.toolCalls[index] ||= { id: '', name: '', arguments: '', at: reply.content.length });
    if (piece.id) call.id = piece.id;
    if (piece.function?.name) call.name += piece.function.name;
    if (piece.function?.arguments) call.arguments += piece.function.arguments;
  }
  reply.mcpCalls ||= [];
  for (const record of delta.mcp_calls || []) {
    reply.mcpCalls.push({
      id: record.id || '',
      name: record.name || '',
      arguments: typeof record.arguments === 'string' ? record.arguments : JSON.stringify(record.arguments ?? {}),
      result: typeof record.result === 'string' ? record.result : JSON.stringify(record.result),
      isError: !!record.is_error,
      at: reply.content.length,
    });
  }
}

/**
 * A reply as it happened: `[{text}, {calls}, {text}, ...]`, its text split where calls were made
 * (the MCP calls the server ran, with results, and those returned to the client). Calls without
 * `at` (kept from before) come first.
 */
export function replyParts(message) {
  const calls = [...(message.mcpCalls || []), ...(message.toolCalls || [])].filter(Boolean)
    .map((call) => ({ ...call, at: Math.min(call.at ?? 0, message.content.length) }))
    .sort((a, b) => a.at - b.at);
  const parts = [];
  let from = 0;
  for (const call of calls) {
    if (call.at > from || !parts.length || parts[parts.length - 1].calls === undefined) {
      parts.push({ text: message.content.slice(from, call.at) }, { calls: [] });
      from = call.at;
    }
    parts[parts.length - 1].calls.push(call);
  }
  parts.push({ text: message.content.slice(from) });
  return parts.filter((part) => part.calls || part.text.trim());
}

/**
 * The MCP servers that are up, have tools and run them for clients, from `GET /v1/mcp/servers`'s
 * `data` (`execute: false`: the operator has not enabled `mcp_execute` for that server).
 */
export function usableMcpServers(servers) {
  return (servers || []).filter((s) => s.status === 'ok' && Array.isArray(s.tools) && s.tools.length > 0
    && s.execute !== false);
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

// The OpenAI-compatible API of the fw server, same origin (the UI server forwards /v1 in-process).

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function headers(apiKey) {
  const h = { 'Content-Type': 'application/json' };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function raiseFor(response) {
  let message = `${response.status} ${response.statusText}`;
  let code;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code;
    }
  } catch {
    /* not JSON */
  }
  throw new ApiError(response.status, message, code);
}

/**
 * The served models (GET /v1/models): `[{id, vision}]`, `vision` being fw's extension field (the
 * model takes images, within its limits) or null (a text-only model, or a server that does not say).
 */
export async function listModels(apiKey) {
  const response = await fetch('/v1/models', { headers: headers(apiKey) });
  if (!response.ok) await raiseFor(response);
  const body = await response.json();
  return body.data.map((m) => ({ id: m.id, vision: m.vision ?? null }));
}

/**
 * The server's MCP servers (GET /v1/mcp/servers, an fw extension): `[{name, transport, status,
 * error, tools}]`; an empty list from a server without that path (another OpenAI-compatible one).
 */
export async function listMcpServers(apiKey) {
  const response = await fetch('/v1/mcp/servers', { headers: headers(apiKey) });
  if (response.status === 404 || response.status === 405) return [];
  if (!response.ok) await raiseFor(response);
  const body = await response.json();
  return Array.isArray(body.data) ? body.data : [];
}

/**
 * Stream a chat completion; calls onDelta(choiceDelta) for every chunk's first choice delta and
 * onUsage(usage) for the final usage chunk. Aborting `signal` closes the connection, which makes
 * the server abort the request.
 */
export async function streamChat({ apiKey, body, signal, onDelta, onUsage }) {
  const response = await fetch('/v1/chat/completions', {
    method: 'POST',
    headers: headers(apiKey),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) await raiseFor(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = '';
  let finishReason = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split('\n')
        .filter((line) => line.startsWith('data:'))
        .map((line) => line.slice(5).trimStart())
        .join('\n');
      if (!data) continue;
      if (data === '[DONE]') return finishReason;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(500, chunk.error.message || 'stream error', chunk.error.code);
      if (chunk.usage) onUsage(chunk.usage);
      const choice = chunk.choices && chunk.choices[0];
      if (choice) {
        if (choice.delta) onDelta(choice.delta);
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
    }
  }
  return finishReason;
}

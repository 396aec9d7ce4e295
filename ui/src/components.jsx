// The pieces of the page: sidebar, messages, settings and API-key dialogs (composer.jsx: the message box).
import { useMemo, useState } from 'preact/hooks';
import { copyText, renderMarkdown } from './markdown.js';
import { prettyJson, replyParts } from './chat.js';
import { MessageImages } from './imageViews.jsx';
import {
  CopyIcon, KeyIcon, PencilIcon, PlugIcon, PlusIcon, RefreshIcon, SearchIcon, TrashIcon,
} from './icons.jsx';

export function Sidebar({ conversations, currentId, onSelect, onNew, onRename, onDelete, open, onClose, streamingId }) {
  const [query, setQuery] = useState('');
  const [editing, setEditing] = useState(null);
  const shown = useMemo(() => {
    const q = query.trim().toLowerCase();
    const sorted = [...conversations].sort((a, b) => b.updatedAt - a.updatedAt);
    if (!q) return sorted;
    return sorted.filter((c) => c.title.toLowerCase().includes(q) || c.messages.some((m) => (m.content || '').toLowerCase().includes(q)));
  }, [conversations, query]);

  return (
    <>
      <div class={`scrim ${open ? 'show' : ''}`} onClick={onClose} />
      <aside class={`sidebar ${open ? 'open' : ''}`} aria-label="Conversations">
        <div class="brand"><span class="logo">fw</span><span>chat</span></div>
        <button class="new-chat" type="button" onClick={onNew} data-testid="new-chat"><PlusIcon /> New chat</button>
        <label class="search">
          <SearchIcon />
          <input type="search" placeholder="Search chats" value={query} onInput={(e) => setQuery(e.currentTarget.value)}
            data-testid="search" aria-label="Search conversations" />
        </label>
        <nav class="conversations" data-testid="conversation-list">
          {shown.length === 0 && <p class="empty-list">{query ? 'No chat matches.' : 'No chats yet.'}</p>}
          {shown.map((c) => (
            <div key={c.id} class={`conversation ${c.id === currentId ? 'active' : ''}`} data-testid="conversation">
              {editing === c.id ? (
                <input class="rename" value={c.title} autoFocus aria-label="Chat title"
                  onKeyDown={(e) => {
                    if (e.key === 'Enter') { onRename(c.id, e.currentTarget.value); setEditing(null); }
                    if (e.key === 'Escape') { e.stopPropagation(); setEditing(null); }
                  }}
                  onBlur={(e) => { onRename(c.id, e.currentTarget.value); setEditing(null); }} />
              ) : (
                <button type="button" class="title" onClick={() => onSelect(c.id)} title={c.title}>
                  {c.id === streamingId && <span class="dot" aria-label="generating" />}
                  {c.title}
                </button>
              )}
              <span class="row-actions">
                <button type="button" class="icon" title="Rename" aria-label="Rename" onClick={() => setEditing(c.id)}><PencilIcon /></button>
                <button type="button" class="icon" title="Delete" aria-label="Delete"
                  onClick={() => { if (window.confirm(`Delete "${c.title}"?`)) onDelete(c.id); }}><TrashIcon /></button>
              </span>
            </div>
          ))}
        </nav>
        <p class="sidebar-foot">Chats are kept in this browser only.</p>
      </aside>
    </>
  );
}

function Markdown({ text, testId }) {
  const html = useMemo(() => renderMarkdown(text), [text]);
  return <div class="markdown" data-testid={testId} dangerouslySetInnerHTML={{ __html: html }} />;
}

/**
 * Tool calls, each folded: its name, its arguments and, for an MCP call the server ran
 * (`result` set), what the tool returned (`isError`: shown as an error).
 */
function ToolCalls({ calls }) {
  return calls.map((call, i) => {
    const ran = typeof call.result === 'string';
    return (
      <details class={`tool ${ran && call.isError ? 'failed' : ''}`} key={`${i}:${call.id}`} data-testid="tool-call">
        <summary>
          <span class="badge">{ran ? 'mcp' : 'tool'}</span> <code>{call.name || '…'}</code>
          {ran && (call.isError ? <span class="done error-tag">error</span> : <span class="done">result</span>)}
        </summary>
        <pre class="plain" data-testid="tool-arguments">{prettyJson(call.arguments)}</pre>
        {ran && (
          <pre class={`plain result ${call.isError ? 'failed' : ''}`} data-testid="tool-result">{call.result}</pre>
        )}
      </details>
    );
  });
}

function Stats({ stats }) {
  if (!stats) return null;
  const parts = [];
  if (stats.completionTokens != null) parts.push(`${stats.completionTokens} tokens`);
  if (stats.tokensPerSecond) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
  if (stats.promptTokens != null) parts.push(`${stats.promptTokens} prompt`);
  if (stats.ttft != null) parts.push(`${(stats.ttft * 1000).toFixed(0)} ms to first token`);
  if (stats.stopped) parts.push(`stopped after ${stats.elapsed.toFixed(1)} s`);
  return <div class="stats" data-testid="stats">{parts.join(' · ')}</div>;
}

export function Message({ message, index, isLast, isStreaming, onEdit, onRegenerate, canAct }) {
  const [editing, setEditing] = useState(false);
  const [draft, setDraft] = useState(message.content);
  const [copied, setCopied] = useState(false);

  const onClick = async (event) => {
    const button = event.target.closest('button[data-copy]');
    if (!button) return;
    const code = button.closest('.code-block')?.querySelector('code');
    if (!code) return;
    await copyText(code.textContent);
    button.textContent = 'Copied';
    setTimeout(() => { button.textContent = 'Copy'; }, 1200);
  };

  if (message.role === 'user') {
    return (
      <div class="msg user" data-testid="user-message">
        {editing ? (
          <div class="edit">
            <textarea value={draft} onInput={(e) => setDraft(e.currentTarget.value)} rows={Math.min(10, draft.split('\n').length + 1)}
              aria-label="Edit message" data-testid="edit-box"
              onKeyDown={(e) => {
                if (e.key === 'Enter' && !e.shiftKey) { e.preventDefault(); setEditing(false); onEdit(index, draft); }
                if (e.key === 'Escape') { e.stopPropagation(); setEditing(false); }
              }} />
            <div class="edit-actions">
              <button type="button" class="ghost" onClick={() => setEditing(false)}>Cancel</button>
              <button type="button" class="primary" data-testid="edit-send" onClick={() => { setEditing(false); onEdit(index, draft); }}>Send</button>
            </div>
          </div>
        ) : (
          <>
            <div class="user-content">
              {message.images?.length > 0 && <MessageImages images={message.images} />}
              {message.content && <div class="bubble">{message.content}</div>}
            </div>
            {canAct && (
              <div class="actions">
                <button type="button" class="icon" title="Edit and resend" aria-label="Edit and resend" data-testid="edit"
                  onClick={() => { setDraft(message.content); setEditing(true); }}><PencilIcon /></button>
              </div>
            )}
          </>
        )}
      </div>
    );
  }

  const parts = replyParts(message);
  const last = parts[parts.length - 1];
  // Nothing yet, or calls made (and the server runs them, then the model writes on).
  const waiting = isStreaming && (last ? !!last.calls : !message.reasoning);
  return (
    <div class="msg assistant" data-testid="assistant-message" onClick={onClick}>
      {message.reasoning && (
        <details class="reasoning" open={isStreaming && !message.content} data-testid="reasoning">
          <summary>{isStreaming && !message.content ? 'Thinking…' : 'Reasoning'}</summary>
          <div class="reasoning-body"><Markdown text={message.reasoning} /></div>
        </details>
      )}
      <div class="reply-body" data-testid="reply-content">
        {parts.map((part, i) => (part.calls ? <ToolCalls key={i} calls={part.calls} /> : <Markdown key={i} text={part.text} />))}
      </div>
      {waiting && <div class="typing" aria-label="waiting for the reply"><span /><span /><span /></div>}
      {message.error && <div class="error" role="alert">{message.error}</div>}
      {!isStreaming && (
        <div class="foot">
          <Stats stats={message.stats} />
          <div class="actions">
            <button type="button" class="icon" title={copied ? 'Copied' : 'Copy reply'} aria-label="Copy reply"
              onClick={async () => { await copyText(message.content); setCopied(true); setTimeout(() => setCopied(false), 1200); }}>
              <CopyIcon />
            </button>
            {isLast && canAct && (
              <button type="button" class="icon" title="Regenerate" aria-label="Regenerate" data-testid="regenerate" onClick={onRegenerate}>
                <RefreshIcon />
              </button>
            )}
          </div>
        </div>
      )}
    </div>
  );
}

export function SettingsPanel({ settings, onChange, onClose }) {
  const field = (name, label, attrs) => (
    <label class="field">
      <span>{label}</span>
      <input type="number" value={settings[name]} data-testid={`setting-${name}`} {...attrs}
        onInput={(e) => onChange({ ...settings, [name]: e.currentTarget.value === '' ? '' : Number(e.currentTarget.value) })} />
    </label>
  );
  return (
    <section class="settings" aria-label="Chat settings" data-testid="settings">
      <div class="settings-head"><h2>Settings for this chat</h2><button type="button" class="ghost" onClick={onClose}>Done</button></div>
      <label class="field wide">
        <span>System prompt</span>
        <textarea rows={3} value={settings.system} placeholder="You are a helpful assistant." data-testid="setting-system"
          onInput={(e) => onChange({ ...settings, system: e.currentTarget.value })} />
      </label>
      <div class="grid">
        {field('temperature', 'Temperature', { min: 0, max: 2, step: 0.1 })}
        {field('top_p', 'Top p', { min: 0, max: 1, step: 0.05 })}
        {field('max_tokens', 'Max tokens', { min: 1, step: 1 })}
      </div>
    </section>
  );
}

export function KeyDialog({ message, onSave, onCancel }) {
  const [key, setKey] = useState('');
  return (
    <div class="modal-backdrop">
      <form class="modal" onSubmit={(e) => { e.preventDefault(); if (key.trim()) onSave(key.trim()); }} data-testid="key-dialog">
        <h2><KeyIcon /> API key required</h2>
        <p>{message || 'This server requires an API key (fw serve --api-key).'} It is kept in this browser.</p>
        <input type="password" autoFocus placeholder="API key" value={key} onInput={(e) => setKey(e.currentTarget.value)}
          aria-label="API key" data-testid="key-input" />
        <div class="edit-actions">
          {onCancel && <button type="button" class="ghost" onClick={onCancel}>Cancel</button>}
          <button type="submit" class="primary" disabled={!key.trim()} data-testid="key-save">Connect</button>
        </div>
      </form>
    </div>
  );
}

/**
 * The MCP servers the fw server has (`GET /v1/mcp/servers`), as a small menu in the header: how
 * many tools the model can use; open, each server with its tools or its error.
 */
export function McpMenu({ servers }) {
  if (!servers.length) return null;
  const tools = servers.reduce((n, s) => n + (s.status === 'ok' ? (s.tools || []).length : 0), 0);
  return (
    <details class="mcp-menu" data-testid="mcp-menu">
      <summary title="MCP tools the server runs for the model">
        <PlugIcon /><span>{tools} {tools === 1 ? 'tool' : 'tools'}</span>
      </summary>
      <div class="mcp-panel">
        <p class="mcp-note">The server runs these MCP tools when the model calls them.</p>
        {servers.map((s) => (
          <div class="mcp-server" key={s.name} data-testid="mcp-server">
            <div class="mcp-name"><code>{s.name}</code> <span class={`mcp-status ${s.status === 'ok' ? '' : 'failed'}`}>{s.status}</span></div>
            {s.error && <div class="mcp-error">{s.error}</div>}
            {s.tools?.length > 0 && <div class="mcp-tools">{s.tools.map((t) => <code key={t}>{t}</code>)}</div>}
          </div>
        ))}
      </div>
    </details>
  );
}

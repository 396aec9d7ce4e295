// fw chat: the app shell (state, streaming, shortcuts). Pieces are in components.jsx.
import { render } from 'preact';
import { useCallback, useEffect, useRef, useState } from 'preact/hooks';
import { ApiError, listMcpServers, listModels, streamChat } from './api.js';
import { noImagesReason, useAttachments, useDropTarget } from './attachments.js';
import { applyDelta, chatRequest, emptyReply, titleFrom, usableMcpServers } from './chat.js';
import { KeyDialog, McpMenu, Message, SettingsPanel, Sidebar } from './components.jsx';
import { Composer } from './composer.jsx';
import { ImageIcon, KeyIcon, MenuIcon, MoonIcon, SlidersIcon, SunIcon } from './icons.jsx';
import { countImages, visionLimits } from './images.js';
import { useKeptImages } from './imageStore.js';
import { DropOverlay } from './imageViews.jsx';
import {
  loadApiKey, loadConversations, loadCurrentId, loadModel, loadTheme, newConversation, saveApiKey, saveConversations,
  saveCurrentId, saveModel, saveTheme,
} from './store.js';
import './style.css';

const SUGGESTIONS = [
  'Explain what a KV cache is',
  'Write a haiku about GPUs',
  'A Python function that reverses a string',
];

function App() {
  const [conversations, setConversations] = useState(loadConversations);
  const keepImages = useKeptImages(conversations, setConversations); // full images across reloads
  const [currentId, setCurrentId] = useState(loadCurrentId);
  const [models, setModels] = useState([]);
  const [visionOf, setVisionOf] = useState({}); // model id -> its card's `vision` field (null: text only)
  const [mcpServers, setMcpServers] = useState([]);
  const [preferredModel, setPreferredModel] = useState(loadModel);
  const [theme, setTheme] = useState(loadTheme);
  const [apiKey, setApiKey] = useState(loadApiKey);
  const [keyPrompt, setKeyPrompt] = useState(null);
  const [banner, setBanner] = useState(null);
  const [sidebarOpen, setSidebarOpen] = useState(false);
  const [settingsOpen, setSettingsOpen] = useState(false);
  const [streaming, setStreaming] = useState(null); // {id, controller}
  const listRef = useRef(null);
  const stickToBottom = useRef(true);

  const current = conversations.find((c) => c.id === currentId) || null;

  useEffect(() => {
    document.documentElement.dataset.theme = theme;
    saveTheme(theme);
  }, [theme]);

  // Saved at once when idle, at most every second while a reply streams in.
  const lastSave = useRef(0);
  useEffect(() => {
    const now = Date.now();
    if (!streaming || now - lastSave.current > 1000) {
      if (!saveConversations(conversations)) {
        setBanner("This browser's storage is full: the newest changes are not saved (delete old chats to make room).");
      }
      lastSave.current = now;
    }
  }, [conversations, streaming]);
  useEffect(() => saveCurrentId(current ? current.id : null), [current?.id]);

  // The served models and MCP servers; ask for a key on 401, retry while the model loads.
  useEffect(() => {
    let timer;
    const load = async () => {
      try {
        const served = await listModels(apiKey);
        // Without the list (an older or another server) the UI just does not ask for MCP tools.
        setMcpServers(await listMcpServers(apiKey).catch(() => []));
        setModels(served.map((m) => m.id));
        setVisionOf(Object.fromEntries(served.map((m) => [m.id, m.vision])));
        setBanner(null);
        setKeyPrompt(null);
      } catch (error) {
        if (error instanceof ApiError && error.status === 401) {
          setKeyPrompt(apiKey ? 'The saved API key was refused.' : 'This server requires an API key.');
        } else {
          setBanner(error instanceof ApiError && error.status === 503 ? `${error.message}` : `Cannot reach the fw server: ${error.message}`);
          timer = setTimeout(load, 2000);
        }
      }
    };
    load();
    return () => clearTimeout(timer);
  }, [apiKey]);

  const defaultModel = models.includes(preferredModel) ? preferredModel : models[0];
  // The server runs the model's MCP tool calls when one of its MCP servers is up with tools.
  const useMcp = usableMcpServers(mcpServers).length > 0;

  const update = useCallback((id, change) => {
    setConversations((list) => list.map((c) => (c.id === id ? { ...change(c), updatedAt: Date.now() } : c)));
  }, []);

  // Keep the newest text in view while streaming, unless the user scrolled up.
  useEffect(() => {
    const el = listRef.current;
    if (el && stickToBottom.current) el.scrollTop = el.scrollHeight;
  });

  const stop = useCallback(() => {
    if (streaming) streaming.controller.abort();
  }, [streaming]);

  useEffect(() => {
    const onKey = (e) => {
      if (e.key === 'Escape' && streaming) {
        e.preventDefault();
        stop();
      }
    };
    window.addEventListener('keydown', onKey);
    return () => window.removeEventListener('keydown', onKey);
  }, [streaming, stop]);

  /** Stream a reply to `conversation` (whose last message is the user's) into a new assistant message. */
  const generate = async (conversation) => {
    const id = conversation.id;
    const controller = new AbortController();
    const reply = emptyReply();
    const body = chatRequest(conversation, { mcp: useMcp });
    update(id, (c) => ({ ...c, title: conversation.title, model: conversation.model, messages: [...conversation.messages, reply] }));
    setStreaming({ id, controller });
    stickToBottom.current = true;

    let frame = 0;
    const flush = () => {
      frame = 0;
      update(id, (c) => ({ ...c, messages: [...c.messages.slice(0, -1), { ...reply }] }));
    };
    const schedule = () => { if (!frame) frame = requestAnimationFrame(flush); };
    const started = performance.now();
    let firstToken = null;
    let usage = null;
    try {
      await streamChat({
        apiKey, body, signal: controller.signal,
        onDelta: (delta) => {
          if (firstToken === null && (delta.content || delta.reasoning_content || delta.reasoning || delta.tool_calls || delta.mcp_calls)) {
            firstToken = performance.now();
          }
          applyDelta(reply, delta);
          schedule();
        },
        onUsage: (u) => { usage = u; },
      });
    } catch (error) {
      if (error.name === 'AbortError') {
        reply.stopped = true;
      } else {
        reply.error = error.message || String(error);
        if (error instanceof ApiError && error.status === 401) setKeyPrompt('The API key was refused.');
      }
    } finally {
      if (frame) cancelAnimationFrame(frame);
      const end = performance.now();
      const seconds = firstToken !== null ? (end - firstToken) / 1000 : null;
      const completionTokens = usage ? usage.completion_tokens : null;
      const elapsed = (end - started) / 1000;
      reply.stats = firstToken === null && !usage ? (reply.stopped ? { stopped: true, elapsed } : null) : {
        completionTokens,
        promptTokens: usage ? usage.prompt_tokens : null,
        // Tokens after the first over the time since it: the decode rate.
        tokensPerSecond: completionTokens > 1 && seconds > 0.01 ? (completionTokens - 1) / seconds : null,
        ttft: firstToken !== null ? (firstToken - started) / 1000 : null,
        stopped: !!reply.stopped,
        elapsed,
      };
      flush();
      setStreaming(null);
    }
  };

  const ensureConversation = () => {
    if (current) return current;
    const conversation = newConversation(defaultModel);
    setConversations((list) => [conversation, ...list]);
    setCurrentId(conversation.id);
    return conversation;
  };

  const send = (text, images = []) => {
    const base = ensureConversation();
    const conversation = {
      ...base,
      model: base.model && models.includes(base.model) ? base.model : defaultModel,
      title: base.messages.length === 0 ? titleFrom(text.trim() ? text : images.map((i) => i.name).join(', ')) : base.title,
      messages: [...base.messages, { role: 'user', content: text, ...(images.length ? { images } : {}) }],
    };
    setConversations((list) => list.map((c) => (c.id === conversation.id ? conversation : c)));
    if (images.length) keepImages(images);
    generate(conversation);
  };

  const editAndResend = (index, text) => {
    const edited = current && { ...current.messages[index], content: text }; // its images stay
    if (!edited || (!text.trim() && !edited.images)) return;
    const conversation = { ...current, messages: [...current.messages.slice(0, index), edited] };
    if (index === 0) conversation.title = titleFrom(text);
    generate(conversation);
  };

  const regenerate = () => {
    if (!current) return;
    const messages = current.messages.slice(0, -1);
    generate({ ...current, messages });
  };

  const newChat = () => {
    if (current && current.messages.length === 0) {
      setSidebarOpen(false);
      return;
    }
    const conversation = newConversation(defaultModel);
    setConversations((list) => [conversation, ...list]);
    setCurrentId(conversation.id);
    setSidebarOpen(false);
    setSettingsOpen(false);
  };

  const deleteChat = (id) => {
    if (streaming && streaming.id === id) streaming.controller.abort();
    setConversations((list) => list.filter((c) => c.id !== id));
    if (id === currentId) setCurrentId(null);
  };

  const isStreamingHere = streaming && current && streaming.id === current.id;
  const model = (current?.model && models.includes(current.model) ? current.model : defaultModel) || '';
  const limits = visionLimits(visionOf[model]);
  const attachReason = !models.length ? 'No model is served yet' : !limits ? noImagesReason(model) : null;
  const attachments = useAttachments({ model, limits, refusal: attachReason, imagesInChat: countImages(current?.messages || []) });
  const drop = useDropTarget(attachments.add); // files dropped on the chat are attached

  return (
    <div class="app">
      <Sidebar conversations={conversations} currentId={currentId} open={sidebarOpen} streamingId={streaming?.id}
        onClose={() => setSidebarOpen(false)} onNew={newChat}
        onSelect={(id) => { setCurrentId(id); setSidebarOpen(false); }}
        onRename={(id, title) => update(id, (c) => ({ ...c, title: title.trim() || c.title }))}
        onDelete={deleteChat} />
      <main class="main" {...drop.handlers}>
        {drop.dragging && <DropOverlay reason={attachReason} />}
        <header class="topbar">
          <button type="button" class="icon menu" aria-label="Show chats" onClick={() => setSidebarOpen(true)}><MenuIcon /></button>
          <select class="model-picker" value={model} aria-label="Model" data-testid="model-picker"
            onChange={(e) => {
              const value = e.currentTarget.value;
              setPreferredModel(value);
              saveModel(value);
              if (current) update(current.id, (c) => ({ ...c, model: value }));
            }}>
            {models.length === 0 && <option value="">no model</option>}
            {models.map((m) => <option key={m} value={m}>{m}</option>)}
          </select>
          {models.length > 0 && (
            <span class={`model-caps ${limits ? 'vision' : ''}`} data-testid="model-vision"
              title={limits ? `${model} takes images: up to ${limits.max_images} in a conversation` : noImagesReason(model)}>
              {limits ? <><ImageIcon width="14" height="14" /> images</> : 'text only'}
            </span>
          )}
          <span class="spacer" />
          <McpMenu servers={mcpServers} />
          <button type="button" class={`icon ${settingsOpen ? 'on' : ''}`} title="Chat settings" aria-label="Chat settings"
            data-testid="settings-toggle" onClick={() => { ensureConversation(); setSettingsOpen(!settingsOpen); }}><SlidersIcon /></button>
          <button type="button" class="icon" title="API key" aria-label="API key" onClick={() => setKeyPrompt('Enter the API key.')}><KeyIcon /></button>
          <button type="button" class="icon" title={theme === 'dark' ? 'Light theme' : 'Dark theme'} aria-label="Toggle theme"
            data-testid="theme-toggle" onClick={() => setTheme(theme === 'dark' ? 'light' : 'dark')}>
            {theme === 'dark' ? <SunIcon /> : <MoonIcon />}
          </button>
        </header>
        {banner && <div class="banner" role="status">{banner}</div>}
        {settingsOpen && current && (
          <SettingsPanel settings={current.settings} onClose={() => setSettingsOpen(false)}
            onChange={(settings) => update(current.id, (c) => ({ ...c, settings }))} />
        )}
        <div class="messages" ref={listRef} data-testid="messages"
          onScroll={(e) => {
            const el = e.currentTarget;
            stickToBottom.current = el.scrollHeight - el.scrollTop - el.clientHeight < 40;
          }}>
          {!current || current.messages.length === 0 ? (
            <div class="welcome">
              <div class="logo big">fw</div>
              <h1>How can I help?</h1>
              <p>{models.length ? <>Chatting with <code>{model}</code></> : 'Connecting to the server…'}</p>
              {models.length > 0 && !streaming && (
                <div class="suggestions">
                  {SUGGESTIONS.map((text) => <button type="button" key={text} onClick={() => send(text)}>{text}</button>)}
                </div>
              )}
            </div>
          ) : (
            <div class="thread">
              {current.messages.map((m, i) => (
                <Message key={`${current.id}-${i}`} message={m} index={i} isLast={i === current.messages.length - 1}
                  isStreaming={isStreamingHere && i === current.messages.length - 1} canAct={!streaming}
                  onEdit={editAndResend} onRegenerate={regenerate} />
              ))}
            </div>
          )}
        </div>
        <div class="composer-wrap">
          {attachments.notice && <p class="attach-notice" role="status" data-testid="attach-notice">{attachments.notice}</p>}
          <Composer onSend={send} onStop={stop} isStreaming={!!isStreamingHere} disabled={!models.length || !!streaming}
            attachments={attachments} attachReason={attachReason} />
          <p class="hint">Enter to send · Shift+Enter for a new line · Esc to stop · replies can be wrong</p>
        </div>
      </main>
      {keyPrompt && (
        <KeyDialog message={keyPrompt} onCancel={models.length ? () => setKeyPrompt(null) : null} onSave={(key) => { saveApiKey(key); setApiKey(key); setKeyPrompt(null); }} />
      )}
    </div>
  );
}

render(<App />, document.getElementById('app'));

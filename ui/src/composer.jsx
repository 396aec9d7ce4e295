// The message box: text, attached images (picked or pasted; drops come through main.jsx), send and stop.
import { useEffect, useRef, useState } from 'preact/hooks';
import { imageFiles } from './images.js';
import { AttachmentTiles } from './imageViews.jsx';
import { ImageIcon, SendIcon, StopIcon } from './icons.jsx';

/**
 * The message box. `attachments` (useAttachments) are the images for the next message, added with
 * the attach button, a paste or (in main.jsx) a drop; `attachReason` says why the model takes none
 * (attaching is then disabled, with that tooltip). `onSend(text, images)`.
 */
export function Composer({ onSend, onStop, isStreaming, disabled, attachments, attachReason }) {
  const [text, setText] = useState('');
  const area = useRef(null);
  const picker = useRef(null);
  useEffect(() => {
    const el = area.current;
    if (!el) return;
    el.style.height = 'auto';
    el.style.height = `${Math.min(el.scrollHeight, 220)}px`;
  }, [text]);
  useEffect(() => { area.current?.focus(); }, []);

  const { items, pending } = attachments;
  const empty = !text.trim() && !items.length;
  const blocked = disabled || pending > 0 || (items.length > 0 && !!attachReason);
  const send = () => {
    if (isStreaming || blocked || empty) return;
    onSend(text, attachments.take());
    setText('');
  };
  const attachTitle = attachReason || 'Attach images (or paste or drop them here)';
  return (
    <form class="composer" onSubmit={(e) => { e.preventDefault(); send(); }}>
      <AttachmentTiles items={items} pending={pending} onRemove={attachments.remove} />
      <span class="attach-wrap" title={attachTitle}>
        <button type="button" class="icon attach" disabled={!!attachReason} title={attachTitle} aria-label="Attach images"
          data-testid="attach" onClick={() => picker.current.click()}><ImageIcon /></button>
      </span>
      <input ref={picker} type="file" accept="image/*" multiple hidden data-testid="attach-input"
        onChange={(e) => { attachments.add(Array.from(e.currentTarget.files)); e.currentTarget.value = ''; }} />
      <textarea ref={area} rows={1} value={text} placeholder="Message fw…"
        aria-label="Message" data-testid="composer"
        onInput={(e) => setText(e.currentTarget.value)}
        onPaste={(e) => {
          const files = imageFiles(e.clipboardData);
          if (files.length) {
            e.preventDefault();
            attachments.add(files);
          }
        }}
        onKeyDown={(e) => {
          if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
        }} />
      {isStreaming ? (
        <button type="button" class="send stop" onClick={onStop} title="Stop (Esc)" aria-label="Stop" data-testid="stop"><StopIcon /></button>
      ) : (
        <button type="submit" class="send" disabled={blocked || empty} title="Send (Enter)" aria-label="Send" data-testid="send"><SendIcon /></button>
      )}
    </form>
  );
}

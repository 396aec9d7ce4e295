// Model output -> safe HTML: marked (GFM) + highlight.js, then DOMPurify. HTML or script in a reply is
// shown as text, never run: marked's raw-HTML tokens are escaped, DOMPurify cleans what marked built,
// and the page's Content-Security-Policy forbids inline script on top.
import { Marked } from 'marked';
import hljs from 'highlight.js/lib/common';
import DOMPurify from 'dompurify';

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' })[c]);
}

const marked = new Marked({
  gfm: true,
  breaks: true,
  renderer: {
    // Raw HTML in the model's text (block or inline) is displayed, not interpreted.
    html({ text }) {
      return escapeHtml(text);
    },
    code({ text, lang }) {
      const language = (lang || '').trim().split(/\s+/)[0];
      let html;
      if (language && hljs.getLanguage(language)) {
        html = hljs.highlight(text, { language, ignoreIllegals: true }).value;
      } else {
        html = text.length < 20000 ? hljs.highlightAuto(text).value : escapeHtml(text);
      }
      const label = escapeHtml(language || 'code');
      return (
        `<div class="code-block"><div class="code-head"><span>${label}</span>` +
        `<button type="button" class="copy-code" data-copy="code">Copy</button></div>` +
        `<pre><code class="hljs">${html}</code></pre></div>`
      );
    },
  },
});

// Links open in a new tab without giving it access to this page.
DOMPurify.addHook('afterSanitizeAttributes', (node) => {
  if (node.tagName === 'A' && node.hasAttribute('href')) {
    node.setAttribute('target', '_blank');
    node.setAttribute('rel', 'noopener noreferrer');
  }
});

/** Render Markdown text to sanitized HTML. */
export function renderMarkdown(text) {
  const html = marked.parse(text || '', { async: false });
  return DOMPurify.sanitize(html, {
    USE_PROFILE: { html: true },
    ADD_TAGS: ['button'],
    ADD_ATTR: ['target', 'data-copy'],
    FORBID_TAGS: ['style', 'form', 'input', 'textarea', 'select'],
  });
}

/** Copy text to the clipboard (also on plain-http pages, where navigator.clipboard is missing). */
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = document.createElement('textarea');
  area.value = text;
  area.style.position = 'fixed';
  area.style.opacity = '0';
  document.body.appendChild(area);
  area.select();
  document.execCommand('copy');
  area.remove();
}

// Conversations, settings, theme and API key, kept in the browser (localStorage).
import { storedImages } from './images.js';

const KEY = 'fw.conversations.v1';
const CURRENT = 'fw.current';

export const DEFAULT_SETTINGS = { system: '', temperature: 0.7, top_p: 1, max_tokens: 512 };

export function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

export function newConversation(model) {
  const now = Date.now();
  return { id: newId(), title: 'New chat', createdAt: now, updatedAt: now, model, settings: { ...DEFAULT_SETTINGS }, messages: [] };
}

export function loadConversations() {
  try {
    const list = JSON.parse(localStorage.getItem(KEY) || '[]');
    return Array.isArray(list) ? list : [];
  } catch {
    return [];
  }
}

/**
 * Save the conversations; false when the browser refused (its storage is full). localStorage holds
 * a few MB per site, so a message's images keep their thumbnails here, and their full copies in
 * IndexedDB (imageStore.js).
 */
export function saveConversations(list) {
  const kept = list.map((c) => (c.messages.some((m) => m.images) ? {
    ...c, messages: c.messages.map((m) => (m.images ? { ...m, images: storedImages(m.images) } : m)),
  } : c));
  try {
    localStorage.setItem(KEY, JSON.stringify(kept));
    return true;
  } catch (error) {
    console.warn('could not save the conversations', error);
    return false;
  }
}

export const loadCurrentId = () => localStorage.getItem(CURRENT);
export const saveCurrentId = (id) => (id ? localStorage.setItem(CURRENT, id) : localStorage.removeItem(CURRENT));

export function loadTheme() {
  const saved = localStorage.getItem('fw.theme');
  if (saved === 'light' || saved === 'dark') return saved;
  return window.matchMedia && window.matchMedia('(prefers-color-scheme: dark)').matches ? 'dark' : 'light';
}
export const saveTheme = (theme) => localStorage.setItem('fw.theme', theme);

export const loadApiKey = () => localStorage.getItem('fw.apiKey') || '';
export const saveApiKey = (key) => (key ? localStorage.setItem('fw.apiKey', key) : localStorage.removeItem('fw.apiKey'));

export const loadModel = () => localStorage.getItem('fw.model') || '';
export const saveModel = (model) => localStorage.setItem('fw.model', model);

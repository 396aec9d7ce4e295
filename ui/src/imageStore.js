// Full images kept in the browser's IndexedDB by image id (localStorage, a few MB, holds only
// thumbnails), and the hook that puts them back into the conversations after a reload.
import { useCallback, useEffect } from 'preact/hooks';

const DB_NAME = 'fw.images';
const STORE = 'images';
let opened = null;

function database() {
  opened ||= new Promise((resolve, reject) => {
    if (!window.indexedDB) {
      reject(new Error('this browser has no IndexedDB'));
      return;
    }
    const request = indexedDB.open(DB_NAME, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(STORE);
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
  opened.catch(() => { opened = null; }); // a later call tries again
  return opened;
}

/** Run `work(store)` in one transaction; resolves with what `work` returned once the transaction commits. */
async function transaction(mode, work) {
  const db = await database();
  return new Promise((resolve, reject) => {
    const tx = db.transaction(STORE, mode);
    const result = work(tx.objectStore(STORE));
    tx.oncomplete = () => resolve(result);
    tx.onerror = () => reject(tx.error);
    tx.onabort = () => reject(tx.error || new Error('the image store refused the write'));
  });
}

/** Keep each image's `url` (its full `data:` URL) under its `id`. Rejects when the browser refuses (quota). */
export const putImages = (images) => transaction('readwrite', (store) => {
  for (const image of images) store.put(image.url, image.id);
});

/** The kept URLs of `ids`, as a Map (ids that are not kept are left out). */
export async function getImages(ids) {
  const requests = await transaction('readonly', (store) => ids.map((id) => [id, store.get(id)]));
  return new Map(requests.filter(([, request]) => typeof request.result === 'string').map(([id, request]) => [id, request.result]));
}

/** Drop every kept image whose id is not in `liveIds` (those of deleted chats or replaced messages). */
export const keepOnly = (liveIds) => transaction('readwrite', (store) => {
  const live = new Set(liveIds);
  const keys = store.getAllKeys();
  keys.onsuccess = () => keys.result.filter((key) => !live.has(key)).forEach((key) => store.delete(key));
});

/** `change(image)` applied to every image of every message (conversations without images stay as they are). */
function mapImages(list, change) {
  return list.map((c) => (c.messages.some((m) => m.images) ? {
    ...c, messages: c.messages.map((m) => (m.images ? { ...m, images: m.images.map(change) } : m)),
  } : c));
}

const imageIds = (list) => list.flatMap((c) => c.messages.flatMap((m) => (m.images || []).map((i) => i.id))).filter(Boolean);

/**
 * Full images across reloads. On mount: the `url` of each image of `initial` (the conversations
 * as loaded) comes back from IndexedDB; one that is not there (or a browser without IndexedDB)
 * keeps its thumbnail only (`stored: false`, and the thread says so); kept images that no
 * conversation holds any more are dropped. Returns `keep(images)`, which stores a sent message's
 * images and marks them `stored` (true, or false when the browser refused).
 */
export function useKeptImages(initial, setConversations) {
  useEffect(() => {
    const wanted = imageIds(initial);
    if (!wanted.length) return;
    const restore = async () => {
      try {
        await keepOnly(wanted);
        return await getImages(wanted);
      } catch (error) {
        console.warn('the kept images could not be read', error);
        return new Map();
      }
    };
    restore().then((urls) => setConversations((list) => mapImages(list, (image) => {
      if (image.url) return image;
      const url = urls.get(image.id);
      return url ? { ...image, url, stored: true } : { ...image, stored: false };
    })));
  }, []);

  return useCallback((images) => {
    const ids = new Set(images.map((image) => image.id));
    const mark = (stored) => setConversations((list) => mapImages(list, (image) => (ids.has(image.id) ? { ...image, stored } : image)));
    putImages(images).then(() => mark(true), (error) => {
      console.warn('the images could not be kept', error);
      mark(false);
    });
  }, [setConversations]);
}

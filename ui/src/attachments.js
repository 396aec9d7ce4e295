// The composer's attached images: from the file picker, a paste or a drop, read within the server's limits.
import { useCallback, useState } from 'preact/hooks';
import { dragHasFiles, readImage } from './images.js';
import { newId } from './store.js';

/** Why `model` takes no image (the attach button's tooltip, and the notice for a paste or a drop). */
export const noImagesReason = (model) => `${model || 'This model'} does not take images (a text-only model)`;

/**
 * Attachments for the next message to `model`, which takes images within `limits` (visionLimits;
 * null: it takes none, for the reason `refusal`, shown when images come anyway). `imagesInChat`: images the conversation holds already (they count
 * against `limits.max_images`). Returns `{items, pending, notice, add(files), remove(index), take()}` (`add` takes
 * any files and refuses those that are not images):
 * `take` hands the items over for sending and empties the composer.
 */
export function useAttachments({ model, limits, refusal, imagesInChat }) {
  const [items, setItems] = useState([]);
  const [pending, setPending] = useState(0);
  const [notice, setNotice] = useState(null);

  const add = useCallback(async (files) => {
    if (!files.length) return;
    if (!limits) {
      setNotice(refusal);
      return;
    }
    const images = files.filter((file) => file.type.startsWith('image/'));
    const room = limits.max_images - imagesInChat - items.length - pending;
    const accepted = images.slice(0, Math.max(0, room));
    if (images.length < files.length) setNotice('Only images can be attached');
    else if (accepted.length < images.length) setNotice(`${model} takes at most ${limits.max_images} images in a conversation`);
    else setNotice(null);
    setPending((n) => n + accepted.length);
    await Promise.all(accepted.map(async (file) => {
      try {
        const image = await readImage(file, limits);
        setItems((list) => [...list, { ...image, id: newId() }]); // the id keeps its full copy (imageStore.js)
      } catch (error) {
        setNotice(error.message);
      } finally {
        setPending((n) => n - 1);
      }
    }));
  }, [model, limits, refusal, imagesInChat, items.length, pending]);

  const remove = useCallback((index) => setItems((list) => list.filter((_, i) => i !== index)), []);
  const take = useCallback(() => {
    const taken = items;
    setItems([]);
    setNotice(null);
    return taken;
  }, [items]);

  return { items, pending, notice, add, remove, take };
}

/**
 * An element that takes dropped files: spread `handlers` on it; `dragging` while files are over
 * it (for an overlay); a drop calls `onFiles(files)`. Drags of text or links are left alone.
 */
export function useDropTarget(onFiles) {
  const [dragging, setDragging] = useState(false);
  const handlers = {
    onDragOver: (e) => {
      if (!dragHasFiles(e)) return;
      e.preventDefault();
      setDragging(true);
    },
    onDragLeave: (e) => {
      if (!e.currentTarget.contains(e.relatedTarget)) setDragging(false);
    },
    onDrop: (e) => {
      if (!dragHasFiles(e)) return;
      e.preventDefault();
      setDragging(false);
      onFiles(Array.from(e.dataTransfer.files));
    },
  };
  return { dragging, handlers };
}

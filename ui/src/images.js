// Images for a vision model: files read into `data:` URLs within the server's limits, and thumbnails.

/** The bounds the UI assumes when the server's model card says a model takes images but not its limits. */
const FALLBACK_LIMITS = {
  max_images: 8,
  formats: ['image/png', 'image/jpeg', 'image/webp', 'image/gif', 'image/bmp'],
  max_image_bytes: 20 * 1024 * 1024,
  max_image_pixels: 64 * 1024 * 1024,
  max_request_bytes: 8 * 1024 * 1024,
};
/** The longest side of a thumbnail: what is kept in the browser's storage and shown in the thread. */
export const THUMBNAIL_SIDE = 384;
const JPEG_QUALITY = 0.9;

/** The model card's `vision` field (fw's extension of GET /v1/models) with every limit filled in. */
export function visionLimits(vision) {
  return vision ? { ...FALLBACK_LIMITS, ...vision } : null;
}

/**
 * The most encoded bytes one image may have so that a conversation holding `max_images` of them
 * still fits the request body cap: the images take at most 3/4 of the body, and base64 turns
 * 3 bytes into 4.
 */
export function imageByteBudget(limits) {
  const share = (limits.max_request_bytes * 3) / 4 / Math.max(1, limits.max_images);
  return Math.floor(Math.min(limits.max_image_bytes, (share * 3) / 4));
}

/** The image files of a paste's DataTransfer (other files and text are left to the text box). */
export function imageFiles(dataTransfer) {
  return Array.from(dataTransfer?.files || []).filter((file) => file.type.startsWith('image/'));
}

/** Whether a drag carries files (a drop target shows itself only for those). */
export const dragHasFiles = (event) => Array.from(event.dataTransfer?.types || []).includes('Files');

const blobToDataUrl = (blob) => new Promise((resolve, reject) => {
  const reader = new FileReader();
  reader.onload = () => resolve(reader.result);
  reader.onerror = () => reject(reader.error);
  reader.readAsDataURL(blob);
});

/** `bitmap` drawn at `width` x `height` on white (the server composites transparency onto white too). */
function draw(bitmap, width, height) {
  const canvas = document.createElement('canvas');
  canvas.width = width;
  canvas.height = height;
  const context = canvas.getContext('2d');
  context.fillStyle = '#fff';
  context.fillRect(0, 0, width, height);
  context.drawImage(bitmap, 0, 0, width, height);
  return canvas;
}

const toJpeg = (canvas, quality) => new Promise((resolve, reject) => {
  canvas.toBlob((blob) => (blob ? resolve(blob) : reject(new Error('the image could not be encoded'))), 'image/jpeg', quality);
});

/** A small JPEG `data:` URL of `bitmap`, its longest side at most THUMBNAIL_SIDE. */
async function thumbnailOf(bitmap) {
  const scale = Math.min(1, THUMBNAIL_SIDE / Math.max(bitmap.width, bitmap.height));
  const canvas = draw(bitmap, Math.max(1, Math.round(bitmap.width * scale)), Math.max(1, Math.round(bitmap.height * scale)));
  return blobToDataUrl(await toJpeg(canvas, 0.8));
}

/**
 * `file` as an attachment `{url, thumb, name, width, height, original}` for a model with `limits`
 * (visionLimits). An image the server takes as it is (an accepted format, within the byte budget
 * and the pixel limit) is sent byte for byte; any other is scaled down (keeping its aspect) and
 * re-encoded as JPEG until it fits, and `original` gives its size before (`{width, height}`).
 * Rejects with a message for a file the browser cannot decode.
 */
export async function readImage(file, limits) {
  let bitmap;
  try {
    bitmap = await createImageBitmap(file);
  } catch {
    throw new Error(`${file.name || 'the file'} is not an image this browser can read`);
  }
  try {
    const { width, height } = bitmap;
    const budget = imageByteBudget(limits);
    const name = file.name || 'image';
    const thumb = await thumbnailOf(bitmap);
    const fits = limits.formats.includes(file.type) && file.size <= budget && width * height <= limits.max_image_pixels;
    if (fits) return { url: await blobToDataUrl(file), thumb, name, width, height, original: null };
    let scale = Math.min(1, Math.sqrt(limits.max_image_pixels / (width * height)));
    for (let attempt = 0; attempt < 12; attempt += 1) {
      const w = Math.max(1, Math.floor(width * scale));
      const h = Math.max(1, Math.floor(height * scale));
      const blob = await toJpeg(draw(bitmap, w, h), JPEG_QUALITY);
      if (blob.size <= budget) {
        return { url: await blobToDataUrl(blob), thumb, name, width: w, height: h, original: { width, height } };
      }
      // Encoded size grows about with the pixel count: aim just under the budget.
      scale *= Math.min(0.9, Math.sqrt(budget / blob.size) * 0.95);
    }
    throw new Error(`${name} could not be made small enough for this server`);
  } finally {
    bitmap.close();
  }
}

/** A user message's images as OpenAI `image_url` content parts (an image whose full copy is lost: its thumbnail). */
export const imageParts = (images) => images.map((image) => ({ type: 'image_url', image_url: { url: image.url || image.thumb } }));

/**
 * The images as kept in localStorage: without their full `url` (it would fill the few MB at once;
 * imageStore.js keeps it in IndexedDB), with their thumbnails.
 */
export const storedImages = (images) => images.map(({ url, ...kept }) => kept);

/** An image's tooltip: its name and size, and whether it was scaled down or only its thumbnail is kept. */
export function imageTitle(image) {
  let title = `${image.name} · ${image.width}×${image.height}`;
  if (image.original) title += ` (scaled down from ${image.original.width}×${image.original.height} to fit the server's limits)`;
  if (isThumbnailOnly(image)) title += ' · only a thumbnail is kept in this browser';
  return title;
}

/** Whether only the image's thumbnail is left (its full copy could not be kept in this browser). */
export const isThumbnailOnly = (image) => !image.url && !image.stored;

/** How many images the messages hold. */
export const countImages = (messages) => messages.reduce((n, m) => n + (m.images ? m.images.length : 0), 0);

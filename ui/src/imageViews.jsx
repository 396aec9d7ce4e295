// Images on the page: the composer's attachments, a user message's images, the drop target.
import { imageTitle, isThumbnailOnly } from './images.js';
import { ImageIcon, XIcon } from './icons.jsx';

/** The composer's attached images (each removable) and a placeholder per image still being read. */
export function AttachmentTiles({ items, pending, onRemove }) {
  if (!items.length && !pending) return null;
  return (
    <div class="attachments" data-testid="attachments">
      {items.map((image, i) => (
        <figure class="attachment" key={i} title={imageTitle(image)} data-testid="attachment">
          <img src={image.thumb} alt={image.name} />
          {image.original && <span class="scaled" data-testid="scaled">scaled</span>}
          <button type="button" class="remove" aria-label={`Remove ${image.name}`} title="Remove" data-testid="remove-attachment"
            onClick={() => onRemove(i)}><XIcon /></button>
        </figure>
      ))}
      {Array.from({ length: pending }, (_, i) => (
        <div class="attachment loading" key={`pending-${i}`} aria-label="reading the image" data-testid="attachment-pending" />
      ))}
    </div>
  );
}

/**
 * A user message's images, shown by their thumbnails. Where the full image could not be kept in
 * the browser (no IndexedDB, or its quota), a note says so and that a follow-up sends the thumbnail.
 */
export function MessageImages({ images }) {
  const thumbnailsOnly = images.some(isThumbnailOnly);
  return (
    <div class="msg-images">
      <div class="msg-images-row">
        {images.map((image, i) => (
          <img key={i} src={image.thumb} alt={image.name} title={imageTitle(image)} data-testid="message-image" />
        ))}
      </div>
      {thumbnailsOnly && (
        <p class="kept-note" data-testid="thumbnail-note">
          This browser kept only thumbnails of these images; a follow-up sends the model these smaller copies.
        </p>
      )}
    </div>
  );
}

/** Shown over the chat while files are dragged over it. */
export function DropOverlay({ reason }) {
  return (
    <div class={`drop-overlay ${reason ? 'refused' : ''}`} data-testid="drop-overlay">
      <div><ImageIcon width="28" height="28" /><p>{reason || 'Drop images to attach them'}</p></div>
    </div>
  );
}

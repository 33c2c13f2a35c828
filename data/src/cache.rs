//! Optional on-disk cache of prepared images (decoded, EXIF-oriented, long side resized to imgsz).
//!
//! Layout: `<dir>/v1-<imgsz>/<fnv64 of the absolute source path>.ptlimg`. Each file holds a header with the format
//! version, imgsz, the source file's length and modification time, the original and resized sizes, then the BGR
//! bytes. An entry whose header does not match the current source file or imgsz is ignored and rewritten. Files are
//! written to a temporary name in the same folder and renamed into place (atomic on POSIX).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use crate::error::{DataError, Result};
use crate::image::Image;

const MAGIC: &[u8; 8] = b"PTLIMG\0\x01";
/// Bump when the preparation (decode/resize) changes.
pub const CACHE_VERSION: u32 = 1;

fn fnv64(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Identity of a source file: (length, mtime in ns).
fn source_stamp(src: &Path) -> Option<(u64, u64)> {
    let md = std::fs::metadata(src).ok()?;
    let mt = md.modified().ok()?.duration_since(UNIX_EPOCH).ok()?.as_nanos() as u64;
    Some((md.len(), mt))
}

/// Cache file path of a source image.
pub fn entry_path(dir: &Path, src: &Path, imgsz: u32) -> PathBuf {
    let abs = std::fs::canonicalize(src).unwrap_or_else(|_| src.to_path_buf());
    let key = fnv64(abs.to_string_lossy().as_bytes());
    dir.join(format!("v{CACHE_VERSION}-{imgsz}")).join(format!("{key:016x}.ptlimg"))
}

fn header(imgsz: u32, stamp: (u64, u64), ori: (u32, u32), w: u32, h: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(48);
    v.extend_from_slice(MAGIC);
    v.extend_from_slice(&CACHE_VERSION.to_le_bytes());
    v.extend_from_slice(&imgsz.to_le_bytes());
    v.extend_from_slice(&stamp.0.to_le_bytes());
    v.extend_from_slice(&stamp.1.to_le_bytes());
    v.extend_from_slice(&ori.0.to_le_bytes());
    v.extend_from_slice(&ori.1.to_le_bytes());
    v.extend_from_slice(&w.to_le_bytes());
    v.extend_from_slice(&h.to_le_bytes());
    v
}

const HEADER_LEN: usize = 8 + 4 + 4 + 8 + 8 + 4 * 4;

fn u32_at(b: &[u8], o: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[o..o + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}

/// Loads a valid entry: (resized image, original (h0, w0)). Any mismatch or damage gives `None`.
pub fn load(dir: &Path, src: &Path, imgsz: u32) -> Option<(Image, (u32, u32))> {
    let stamp = source_stamp(src)?;
    let bytes = ptl_files::read_regular(&entry_path(dir, src, imgsz)).ok()?;
    if bytes.len() < HEADER_LEN || &bytes[..8] != MAGIC {
        return None;
    }
    if u32_at(&bytes, 8) != CACHE_VERSION || u32_at(&bytes, 12) != imgsz {
        return None;
    }
    if u64_at(&bytes, 16) != stamp.0 || u64_at(&bytes, 24) != stamp.1 {
        return None;
    }
    let ori = (u32_at(&bytes, 32), u32_at(&bytes, 36));
    let (w, h) = (u32_at(&bytes, 40), u32_at(&bytes, 44));
    let n = w as usize * h as usize * 3;
    if bytes.len() != HEADER_LEN + n || w == 0 || h == 0 {
        return None;
    }
    Some((Image { w, h, data: bytes[HEADER_LEN..].to_vec() }, ori))
}

/// Writes an entry atomically (temporary file + rename).
pub fn store(dir: &Path, src: &Path, imgsz: u32, img: &Image, ori: (u32, u32)) -> Result<()> {
    let Some(stamp) = source_stamp(src) else {
        return Ok(());
    };
    let path = entry_path(dir, src, imgsz);
    let parent = path.parent().map(Path::to_path_buf).unwrap_or_default();
    std::fs::create_dir_all(&parent).map_err(|e| DataError::io(&parent, e))?;
    let tmp = parent.join(format!(
        ".{}.{}.{:?}.tmp",
        path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
        std::process::id(),
        std::thread::current().id()
    ));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&header(imgsz, stamp, ori, img.w, img.h))?;
        f.write_all(&img.data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        DataError::io(&path, e)
    })
}

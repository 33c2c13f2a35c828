//! Cache files another local user cannot forge.
//!
//! A checksum stored beside a payload detects damage, not tampering: whoever can write the file can
//! recompute it. Compiled kernels and serialized cuDNN plans are executed as they are read, so
//! they carry an HMAC-SHA-256 under a per-user key instead. The key (32 random bytes) is made at
//! first use in the user's private cache folder, mode 0600, and is used only if it is still this
//! user's and readable by nobody else.

use std::io::Read;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{FileError, Result};

/// Bytes of a seal (an HMAC-SHA-256 tag).
pub const SEAL_LEN: usize = 32;

const MAGIC: &[u8; 9] = b"PTLSEAL1\n";
const KEY_NAME: &str = "seal.key";

/// Signs and checks cache files with the user's key.
#[derive(Clone)]
pub struct Sealer {
    key: [u8; SEAL_LEN],
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer { key: <hidden> }")
    }
}

impl Sealer {
    /// The key kept in folder `dir` (made there if missing). The folder should be private
    /// ([`crate::private_dir`]); the key file itself must be a regular file of this user that
    /// nobody else can read or write.
    pub fn in_dir(dir: &Path) -> Result<Sealer> {
        let path = dir.join(KEY_NAME);
        match create_key(&path) {
            Ok(key) => return Ok(Sealer { key }),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(FileError::io(&path, e)),
        }
        read_key(&path)
    }

    /// `payload` headed by its seal and length.
    pub fn seal(&self, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAGIC.len() + SEAL_LEN + 8 + payload.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.mac(payload).finalize().into_bytes());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// The payload of a sealed file, or why it is not to be trusted.
    pub fn unseal<'a>(&self, bytes: &'a [u8]) -> std::result::Result<&'a [u8], &'static str> {
        let rest = bytes.strip_prefix(MAGIC.as_slice()).ok_or("not a sealed ptl cache file")?;
        if rest.len() < SEAL_LEN + 8 {
            return Err("truncated header");
        }
        let (tag, rest) = rest.split_at(SEAL_LEN);
        let (len, payload) = rest.split_at(8);
        let len = u64::from_le_bytes(len.try_into().map_err(|_| "bad length")?);
        if payload.len() as u64 != len {
            return Err("truncated payload");
        }
        self.mac(payload).verify_slice(tag).map_err(|_| "seal mismatch (damaged, or not written by you)")?;
        Ok(payload)
    }

    fn mac(&self, payload: &[u8]) -> Hmac<Sha256> {
        // HMAC takes keys of any length: `new_from_slice` cannot fail here.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.key).unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
        m.update(payload);
        m
    }
}

/// Makes a new key file (`O_EXCL`, 0600) with 32 bytes from the system's random source.
fn create_key(path: &Path) -> std::io::Result<[u8; SEAL_LEN]> {
    let mut key = [0u8; SEAL_LEN];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut key)?;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600).custom_flags(libc::O_NOFOLLOW);
    }
    let mut f = opts.open(path)?;
    std::io::Write::write_all(&mut f, &key)?;
    f.sync_all()?;
    Ok(key)
}

fn read_key(path: &Path) -> Result<Sealer> {
    let not_private = |reason: String| FileError::NotPrivate { path: PathBuf::from(path), reason };
    let mut f = crate::open_regular(path)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let m = f.metadata().map_err(|e| FileError::io(path, e))?;
        if m.uid() != crate::private::current_uid() {
            return Err(not_private(format!("the cache key belongs to user id {}", m.uid())));
        }
        if m.mode() & 0o077 != 0 {
            return Err(not_private(format!("others can read or write the cache key (mode {:o})", m.mode() & 0o777)));
        }
    }
    let mut key = [0u8; SEAL_LEN];
    let mut extra = [0u8; 1];
    f.read_exact(&mut key).map_err(|_| not_private("the cache key is shorter than 32 bytes".into()))?;
    if f.read(&mut extra).map_err(|e| FileError::io(path, e))? != 0 {
        return Err(not_private("the cache key is longer than 32 bytes".into()));
    }
    Ok(Sealer { key })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_file_opens_only_under_its_key_and_unchanged() {
        let d = tempfile::tempdir().unwrap();
        let s = Sealer::in_dir(d.path()).unwrap();
        let again = Sealer::in_dir(d.path()).unwrap();
        let file = s.seal(b"cubin bytes");
        assert_eq!(again.unseal(&file), Ok(&b"cubin bytes"[..]), "the same key from the file");
        let mut flipped = file.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(s.unseal(&flipped).unwrap_err().contains("seal mismatch"));
        assert_eq!(s.unseal(&file[..file.len() - 1]), Err("truncated payload"));
        assert_eq!(s.unseal(b"PTLCUBIN1\n..."), Err("not a sealed ptl cache file"));
        // Another user's key (another folder) does not accept the file, and a forger without the
        // key cannot make one: a plain SHA-256 in the tag's place fails.
        let other = tempfile::tempdir().unwrap();
        assert!(Sealer::in_dir(other.path()).unwrap().unseal(&file).is_err());
        use sha2::Digest;
        let mut forged = file.clone();
        forged[MAGIC.len()..MAGIC.len() + SEAL_LEN].copy_from_slice(&sha2::Sha256::digest(b"cubin bytes"));
        assert!(s.unseal(&forged).is_err());
    }

    #[cfg(unix)]
    #[test]
    fn a_key_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        Sealer::in_dir(d.path()).unwrap();
        let key = d.path().join(KEY_NAME);
        assert_eq!(std::fs::metadata(&key).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Sealer::in_dir(d.path()).unwrap_err();
        assert!(e.to_string().contains("others can read or write the cache key"), "{e}");
    }
}

//! vnetd's WireGuard key pair, kept in `--wireguard-key-file` (`wg genkey`'s
//! format; mode 600, owned by vnetd's user; made with a new key if missing).

use boringtun::x25519::{PublicKey, StaticSecret};
use std::path::Path;

/// vnetd's WireGuard key pair.
pub struct WgKeys {
    pub(super) secret: StaticSecret,
    pub public: PublicKey,
}

impl WgKeys {
    pub fn new(secret: [u8; 32]) -> WgKeys {
        let secret = StaticSecret::from(secret);
        let public = PublicKey::from(&secret);
        WgKeys { secret, public }
    }

    /// Reads the key file `wg genkey` writes (base64, 32 bytes) or, if there
    /// is none, makes one (mode 600) with a new key. The file must be a
    /// regular file owned by vnetd's user and readable by nobody else.
    pub fn load_or_create(path: &Path) -> Result<WgKeys, String> {
        if std::fs::symlink_metadata(path).is_err() {
            let keys = WgKeys::write_new(path)?;
            tracing::info!("made a new WireGuard key in {}", path.display());
            return Ok(keys);
        }
        let bytes = super::super::read_secret(path, 4096)?;
        let text = std::str::from_utf8(&bytes).map_err(|_| format!("{} is not a WireGuard key file (not text)", path.display()))?;
        let key = vnet_core::command::parse_wireguard_key(text).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(WgKeys::new(key))
    }

    pub fn public_text(&self) -> String {
        vnet_core::command::wireguard_key_text(self.public.as_bytes())
    }

    /// A new key pair, written to `path` (mode 600) in place of what it
    /// held: a new file renamed over it, so the file always holds a whole key.
    pub(super) fn write_new(path: &Path) -> Result<WgKeys, String> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut key = [0u8; 32];
        getrandom::getrandom(&mut key).map_err(|e| format!("no randomness for a WireGuard key: {e}"))?;
        let text = vnet_core::command::wireguard_key_text(&key);
        let tmp = path.with_extension("new");
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
            .map_err(|e| format!("cannot make WireGuard key file {}: {e}", tmp.display()))?;
        f.write_all(format!("{text}\n").as_bytes()).and_then(|_| f.sync_all()).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, path).map_err(|e| format!("cannot replace {}: {e}", path.display()))?;
        Ok(WgKeys::new(key))
    }
}


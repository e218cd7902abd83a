//! A link's shared key (`LINK ADD ... tcp <key-name>`, a link's `vtoe
//! <key-name>`): the secret both ends' key handshakes prove they hold
//! (`vnet_core::linkauth`), read from a file in `--link-key-dir`.

use std::path::Path;
use std::sync::Arc;
use vnet_core::linkauth;

/// A link's key, read from its key file.
#[derive(Clone)]
pub struct LinkKey(Arc<[u8]>);

impl LinkKey {
    /// Reads key file `name` from `dir`. The file must be a regular file
    /// (not a link) owned by vnetd's user and readable by nobody else; its
    /// bytes, less one trailing newline, are the key (16 bytes at least).
    pub fn load(dir: &Path, name: &str) -> Result<LinkKey, String> {
        let path = dir.join(name);
        let key = super::read_secret(&path, 4096).map_err(|e| if e.starts_with("cannot open") { format!("{e} (see --link-key-dir)") } else { e })?;
        if key.len() < linkauth::MIN_KEY_LEN {
            return Err(format!("key file {} holds {} bytes; a key has {} at least", path.display(), key.len(), linkauth::MIN_KEY_LEN));
        }
        Ok(LinkKey(key.into()))
    }

    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}


#[cfg(test)]
impl LinkKey {
    pub fn test_key(key: &[u8]) -> LinkKey {
        LinkKey(Arc::from(key))
    }
}

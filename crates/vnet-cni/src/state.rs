//! The record of each attachment: `<stateDir>/<CNI network>/<containerid>-<ifname>`,
//! JSON. It is what makes DEL exact (the socket, names and mount ADD used,
//! even if the config changed) and what `vnet-cni restore` replays into a
//! restarted vnetd. Every command that reads or changes records holds an
//! exclusive lock on `<stateDir>/.lock`, so ADD, DEL, GC and restore never
//! interleave (plugins run concurrently for different containers).

use crate::config::Routes;
use crate::error::{code, CniError, CniResult};
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// One attachment, as ADD made it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    pub container_id: String,
    pub ifname: String,
    /// The CNI network's name.
    pub cni_network: String,
    /// CNI_NETNS as the runtime gave it.
    pub netns: String,
    /// Its name in /run/netns, as vnetd was given it.
    pub netns_name: String,
    /// The plugin bind-mounted the namespace to /run/netns/<netnsName>.
    pub netns_bound: bool,
    /// vnetd's control socket.
    pub socket: PathBuf,
    /// vnetd's interface name.
    pub interface: String,
    pub mac: String,
    /// The VNET network.
    pub network: String,
    pub mtu: u32,
    pub routes: Routes,
    /// The lines of the one request that made it in vnetd, replayed by
    /// `vnet-cni restore`.
    pub commands: Vec<String>,
}

pub struct Store {
    root: PathBuf,
}

fn io_error(what: String) -> impl FnOnce(std::io::Error) -> CniError {
    move |e| CniError::new(code::STATE, format!("{what}: {e}"))
}

impl Store {
    pub fn new(root: &Path) -> Store {
        Store { root: root.to_path_buf() }
    }

    /// Takes the store's lock (made, with the directory, on first use),
    /// held until the returned guard is dropped.
    pub fn lock(&self) -> CniResult<Flock<File>> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.root)
            .map_err(io_error(format!("cannot make state directory {}", self.root.display())))?;
        let path = self.root.join(".lock");
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(io_error(format!("cannot open {}", path.display())))?;
        Flock::lock(f, FlockArg::LockExclusive)
            .map_err(|(_, e)| CniError::new(code::STATE, format!("cannot lock {}: {e}", path.display())))
    }

    pub fn path(&self, cni_network: &str, container_id: &str, ifname: &str) -> PathBuf {
        self.root.join(cni_network).join(format!("{container_id}-{ifname}"))
    }

    /// The record of an attachment, if there is one.
    pub fn load(&self, cni_network: &str, container_id: &str, ifname: &str) -> CniResult<Option<Record>> {
        let path = self.path(cni_network, container_id, ifname);
        match fs::read(&path) {
            Ok(bytes) => read_record(&path, &bytes).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_error(format!("cannot read {}", path.display()))(e)),
        }
    }

    /// Writes a record whole (a temporary file renamed over it).
    pub fn save(&self, r: &Record) -> CniResult<()> {
        let path = self.path(&r.cni_network, &r.container_id, &r.ifname);
        let dir = path.parent().expect("a record lives in its network's directory");
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_error(format!("cannot make {}", dir.display())))?;
        let tmp = dir.join(format!(".{}.tmp", path.file_name().expect("a file name").to_string_lossy()));
        let text = serde_json::to_string_pretty(r).expect("a record serializes") + "\n";
        let write = || -> std::io::Result<()> {
            let mut f = OpenOptions::new().create(true).truncate(true).write(true).mode(0o600).open(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            fs::rename(&tmp, &path)
        };
        write().map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io_error(format!("cannot write {}", path.display()))(e)
        })
    }

    /// Removes a record (none there is fine).
    pub fn remove(&self, cni_network: &str, container_id: &str, ifname: &str) -> CniResult<()> {
        let path = self.path(cni_network, container_id, ifname);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_error(format!("cannot remove {}", path.display()))(e)),
            _ => Ok(()),
        }
    }

    /// Every record of one CNI network, or of all: (path, the record or
    /// why it could not be read).
    pub fn list(&self, cni_network: Option<&str>) -> Vec<(PathBuf, CniResult<Record>)> {
        let dirs: Vec<PathBuf> = match cni_network {
            Some(n) => vec![self.root.join(n)],
            None => entries(&self.root).into_iter().filter(|p| p.is_dir()).collect(),
        };
        let mut out = Vec::new();
        for dir in dirs {
            for path in entries(&dir).into_iter().filter(|p| p.is_file()) {
                let r = fs::read(&path)
                    .map_err(io_error(format!("cannot read {}", path.display())))
                    .and_then(|b| read_record(&path, &b));
                out.push((path, r));
            }
        }
        out
    }
}

/// A directory's entries, sorted, without hidden ones (the lock,
/// temporary files).
fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn read_record(path: &Path, bytes: &[u8]) -> CniResult<Record> {
    serde_json::from_slice(bytes)
        .map_err(|e| CniError::new(code::STATE, format!("state file {} is not a record: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> Record {
        Record {
            container_id: id.into(),
            ifname: "eth0".into(),
            cni_network: "net".into(),
            netns: "/run/netns/x".into(),
            netns_name: "x".into(),
            netns_bound: false,
            socket: "/run/vnetd.sock".into(),
            interface: "c0123456789ab".into(),
            mac: "02:00:00:00:00:01".into(),
            network: "blue".into(),
            mtu: 1458,
            routes: Routes::Local,
            commands: vec!["INTERFACE ADD ...".into()],
        }
    }

    #[test]
    fn saves_loads_lists_and_removes() {
        let root = std::env::temp_dir().join(format!("vnet-cni-state-{}", std::process::id()));
        let s = Store::new(&root);
        let _lock = s.lock().unwrap();
        assert_eq!(s.load("net", "a", "eth0").unwrap(), None);
        s.save(&record("a")).unwrap();
        s.save(&record("b")).unwrap();
        assert_eq!(s.load("net", "a", "eth0").unwrap(), Some(record("a")));
        assert!(root.join("net/a-eth0").is_file());
        fs::write(root.join("net/junk"), "{").unwrap();
        let all = s.list(None);
        assert_eq!(all.len(), 3, "the lock and temporary files are not listed");
        assert_eq!(all.iter().filter(|(_, r)| r.is_ok()).count(), 2);
        assert_eq!(s.list(Some("other")).len(), 0);
        s.remove("net", "a", "eth0").unwrap();
        s.remove("net", "a", "eth0").unwrap();
        assert_eq!(s.load("net", "a", "eth0").unwrap(), None);
        fs::remove_dir_all(&root).unwrap();
    }
}

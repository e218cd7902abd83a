//! vnetd's run-time state on file (`--state`): every committed request's
//! changes, so that a vnetd started again restores what it was told at run
//! time (the CNI plugin's interfaces, vnet-agent's links and routes,
//! `vnetctl`'s changes) before anything is swept from the kernel datapath.
//!
//! It is a log, as ovsdb's is: a snapshot of the whole state, then one
//! record per committed request, appended with one `write` before the
//! request is answered, so a change costs the same whatever the table's
//! size. When the records outgrow the snapshot, a new snapshot is written
//! beside the file and renamed over it (atomic: the file always holds one
//! whole state). Text in the control language's canonical lines
//! (`vnet_core::render`), one record after another:
//!
//! ```text
//! @vnetd-state 1
//! @config /etc/vnet/vnetd.conf        the config file and its lines as last applied
//! 3 INTERFACE ADD g1 02:00:00:00:00:01 netns g1 veth network default
//! @commit
//! @snapshot                           every object and setting, one line each
//! INTERFACE ADD ...
//! @commit
//! @request                            one committed request's changes
//! ROUTE ADD ... owner agent
//! @commit
//! ```
//!
//! A record without its `@commit` (vnetd killed in the middle of a
//! `write`) was never answered: it is ignored, and said. The file is
//! vnetd's: anything else in it is refused with the line and the reason,
//! and vnetd does not start (move the file away, or `--state none`).
//! One vnetd per file (a lock beside it, `<file>.lock`).

use anyhow::{bail, Context, Result};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

const HEADER: &str = "@vnetd-state 1";

/// A config file and its changes (line number, text) as last applied.
pub type Applied = (PathBuf, Vec<(usize, String)>);

/// One record of the file.
#[derive(Debug, PartialEq)]
pub enum Record {
    /// The whole state: restored line by line (a line that fails, say an
    /// interface whose namespace is gone, is skipped and said).
    Snapshot(Vec<String>),
    /// One request's changes: restored all or nothing, as it was applied.
    Request(Vec<String>),
    /// The config file as last applied (what `RELOAD` compares with).
    Config(Applied),
}

pub struct Journal {
    path: PathBuf,
    file: File,
    _lock: nix::fcntl::Flock<File>,
    /// Lines appended since the last snapshot, and that snapshot's.
    appended: usize,
    snapshot: usize,
}

impl Journal {
    /// Opens (making it if missing) the state file at `path`, locked for
    /// this vnetd, and reads the records it holds.
    pub fn open(path: &Path) -> Result<(Journal, Vec<Record>)> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if !dir.exists() {
                std::fs::create_dir_all(dir).with_context(|| format!("--state: cannot make {}", dir.display()))?;
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
            }
        }
        let lock_path = PathBuf::from(format!("{}.lock", path.display()));
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .with_context(|| format!("--state: cannot open {}", lock_path.display()))?;
        let Ok(lock) = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock) else {
            bail!("--state {}: another vnetd records its state there (give each vnetd its own file)", path.display());
        };
        let mut fresh = false;
        let records = match std::fs::read_to_string(path) {
            Ok(text) if text.is_empty() => {
                fresh = true;
                Vec::new()
            }
            Ok(text) => parse(&text).map_err(|e| anyhow::anyhow!("--state {}: {e}; move it away (or start with --state none) to start without it", path.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fresh = true;
                Vec::new()
            }
            Err(e) => return Err(e).with_context(|| format!("--state: cannot read {}", path.display())),
        };
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
            .with_context(|| format!("--state: cannot open {}", path.display()))?;
        let mut j = Journal { path: path.to_path_buf(), file, _lock: lock, appended: 0, snapshot: 0 };
        if fresh {
            j.write(&format!("{HEADER}\n"))?;
        }
        Ok((j, records))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one committed request's changes.
    pub fn request(&mut self, lines: &[String]) -> Result<()> {
        self.appended += lines.len();
        self.write(&record("@request", lines))
    }

    /// Appends the config as now applied.
    pub fn config(&mut self, applied: &Applied) -> Result<()> {
        self.write(&config_record(applied))
    }

    /// Whether the records since the snapshot outgrew it (then a new
    /// snapshot is due: `compact`).
    pub fn due(&self) -> bool {
        self.appended > self.snapshot.max(4096)
    }

    /// Replaces the file by one holding `config` and a snapshot of the
    /// state, `lines`: written beside it and renamed over it.
    pub fn compact(&mut self, config: Option<&Applied>, lines: &[String]) -> Result<()> {
        let tmp = PathBuf::from(format!("{}.new", self.path.display()));
        let mut text = format!("{HEADER}\n");
        if let Some(c) = config {
            text.push_str(&config_record(c));
        }
        text.push_str(&record("@snapshot", lines));
        {
            let mut f = OpenOptions::new().create(true).write(true).truncate(true).mode(0o600).open(&tmp)?;
            f.write_all(text.as_bytes())?;
        }
        std::fs::rename(&tmp, &self.path)?;
        self.file = OpenOptions::new().append(true).open(&self.path)?;
        self.snapshot = lines.len();
        self.appended = 0;
        Ok(())
    }

    fn write(&mut self, text: &str) -> Result<()> {
        self.file.write_all(text.as_bytes()).with_context(|| format!("cannot write the state file {}", self.path.display()))
    }
}

fn record(head: &str, lines: &[String]) -> String {
    let mut s = String::with_capacity(lines.iter().map(|l| l.len() + 1).sum::<usize>() + 32);
    s.push_str(head);
    s.push('\n');
    for l in lines {
        s.push_str(l);
        s.push('\n');
    }
    s.push_str("@commit\n");
    s
}

fn config_record((path, lines): &Applied) -> String {
    let body: Vec<String> = lines.iter().map(|(n, l)| format!("{n} {l}")).collect();
    record(&format!("@config {}", path.display()), &body)
}

/// The records of a state file's text; a last record cut short is left out
/// (and said).
pub fn parse(text: &str) -> Result<Vec<Record>, String> {
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
    match lines.next() {
        Some((_, HEADER)) => {}
        Some((_, l)) if l.starts_with("@vnetd-state ") => return Err(format!("line 1: a state file of another version: {l}")),
        Some((_, l)) => return Err(format!("line 1: not a vnetd state file: {l}")),
        None => return Ok(Vec::new()),
    }
    let mut out = Vec::new();
    let mut open: Option<(usize, String, Vec<String>)> = None;
    for (n, l) in lines {
        match (&mut open, l.strip_prefix('@')) {
            (None, Some(head)) => {
                let known = head == "snapshot" || head == "request" || head.starts_with("config ");
                if !known {
                    return Err(format!("line {n}: not a record: {l}"));
                }
                open = Some((n, head.to_string(), Vec::new()));
            }
            (None, None) => return Err(format!("line {n}: outside a record: {l}")),
            (Some(_), Some("commit")) => {
                let (at, head, body) = open.take().expect("open");
                out.push(match head.as_str() {
                    "snapshot" => Record::Snapshot(body),
                    "request" => Record::Request(body),
                    _ => {
                        let path = PathBuf::from(head.trim_start_matches("config "));
                        let mut applied = Vec::new();
                        for (k, b) in body.iter().enumerate() {
                            let parsed = b.split_once(' ').and_then(|(num, line)| Some((num.parse::<usize>().ok()?, line.to_string())));
                            applied.push(parsed.ok_or_else(|| format!("line {}: not '<line number> <change>': {b}", at + 1 + k))?);
                        }
                        Record::Config((path, applied))
                    }
                });
            }
            (Some(_), Some(_)) => return Err(format!("line {n}: a record inside a record: {l}")),
            (Some((.., body)), None) => body.push(l.to_string()),
        }
    }
    if let Some((at, head, _)) = open {
        tracing::warn!("state file: the last record (@{head}, line {at}) was cut short (vnetd stopped while writing it, before it answered): left out");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_read_back_and_a_cut_one_is_left_out() {
        let dir = std::env::temp_dir().join(format!("vnetd-journal-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("sub/state");
        let (j, recs) = Journal::open(&path).unwrap();
        assert!(recs.is_empty());
        drop(j);
        // Opened again with nothing recorded yet: still one header.
        let (mut j, recs) = Journal::open(&path).unwrap();
        assert!(recs.is_empty());
        j.config(&(PathBuf::from("/etc/v.conf"), vec![(3, "SET quota 32".into())])).unwrap();
        j.request(&["INTERFACE ADD g1 02:00:00:00:00:01".into(), "ROUTE ADD any any edge h2 any".into()]).unwrap();
        // A second vnetd on the same file is refused.
        assert!(Journal::open(&path).err().unwrap().to_string().contains("another vnetd"));
        drop(j);
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("@request\nLINK DEL h2\n");
        std::fs::write(&path, &text).unwrap();
        let (mut j, recs) = Journal::open(&path).unwrap();
        assert_eq!(
            recs,
            vec![
                Record::Config((PathBuf::from("/etc/v.conf"), vec![(3, "SET quota 32".into())])),
                Record::Request(vec!["INTERFACE ADD g1 02:00:00:00:00:01".into(), "ROUTE ADD any any edge h2 any".into()]),
            ]
        );
        j.compact(None, &["SET quota 8".into()]).unwrap();
        j.request(&["SET quota 9".into()]).unwrap();
        drop(j);
        let (_, recs) = Journal::open(&path).unwrap();
        assert_eq!(recs, vec![Record::Snapshot(vec!["SET quota 8".into()]), Record::Request(vec!["SET quota 9".into()])]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_vnetd_did_not_write_is_refused_with_the_line() {
        assert!(parse("hello\n").unwrap_err().starts_with("line 1: not a vnetd state file"));
        assert!(parse("@vnetd-state 2\n").unwrap_err().contains("another version"));
        assert!(parse("@vnetd-state 1\nSET quota 3\n").unwrap_err().starts_with("line 2: outside a record"));
        assert!(parse("@vnetd-state 1\n@bogus\n").unwrap_err().starts_with("line 2: not a record"));
        assert!(parse("@vnetd-state 1\n@request\n@snapshot\n").unwrap_err().starts_with("line 3: a record inside"));
        assert!(parse("@vnetd-state 1\n@config /x\nfoo\n@commit\n").unwrap_err().starts_with("line 3: not '<line number>"));
        assert_eq!(parse("").unwrap(), vec![]);
    }
}

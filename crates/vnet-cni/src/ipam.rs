//! IPAM delegation (the spec's section 4): the IPAM plugin named by
//! `ipam.type` is found in CNI_PATH and run with this plugin's environment
//! (CNI_COMMAND and, for GC's stale attachments, the attachment's own
//! variables replaced) and the whole network config on stdin; its stderr is
//! ours, its stdout its result or its CNI error, which is passed on as is.
//!
//! One liberty, for IPAM plugins older than the config: when the plugin does
//! not speak the config's `cniVersion` (Debian's host-local 1.1.1 stops at
//! 1.0.0, so a 1.1.0 config would be refused), the config is given to it with
//! the highest version it speaks of the same major version (1.0.0 for
//! 1.1.0), whose results read the same. STATUS and GC exist from 1.1.0 on:
//! they are forwarded only to a plugin that speaks 1.1.0.

use crate::config::{version_tuple, NetConf};
use crate::error::{code, CniError, CniResult};
use crate::result::AddResult;
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// An attachment's CNI variables, for running the IPAM plugin on behalf of
/// an attachment other than the invocation's own (GC).
#[derive(Clone, Debug)]
pub struct Attachment<'a> {
    pub container_id: &'a str,
    pub ifname: &'a str,
    pub netns: Option<&'a str>,
}

pub struct Ipam {
    plugin: PathBuf,
    /// The config as the plugin is to read it (its version negotiated).
    stdin: Vec<u8>,
    /// Whether it speaks 1.1.0 (and so STATUS and GC).
    speaks_1_1: bool,
}

impl Ipam {
    /// The IPAM plugin of `conf`, if it has one, ready to run.
    pub fn of(conf: &NetConf) -> CniResult<Option<Ipam>> {
        let Some(kind) = &conf.ipam else { return Ok(None) };
        let cni_path = std::env::var("CNI_PATH").unwrap_or_default();
        let plugin = find_plugin(kind, &cni_path)?;
        let theirs = supported_versions(&plugin, &conf.cni_version);
        let version = negotiate(&conf.cni_version, &theirs).ok_or_else(|| {
            CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!("IPAM plugin {kind} supports CNI versions {theirs:?}, none compatible with {}", conf.cni_version),
            )
        })?;
        let stdin = if version == conf.cni_version {
            serde_json::to_vec(&conf.raw)
        } else {
            let mut raw = conf.raw.clone();
            raw["cniVersion"] = Value::String(version);
            serde_json::to_vec(&raw)
        }
        .expect("a JSON value serializes");
        Ok(Some(Ipam { plugin, stdin, speaks_1_1: theirs.iter().any(|v| v == "1.1.0") }))
    }

    pub fn add(&self) -> CniResult<AddResult> {
        let out = self.run("ADD", None)?;
        let v: Value = serde_json::from_slice(&out).map_err(|e| self.failed(format!("its ADD result is not JSON: {e}")))?;
        AddResult::parse(&v).map_err(|e| self.failed(format!("its ADD result: {e}")))
    }

    pub fn del(&self, attachment: Option<&Attachment>) -> CniResult<()> {
        self.run("DEL", attachment).map(drop)
    }

    pub fn check(&self) -> CniResult<()> {
        self.run("CHECK", None).map(drop)
    }

    /// STATUS, where the plugin has it.
    pub fn status(&self) -> CniResult<()> {
        if self.speaks_1_1 {
            self.run("STATUS", None)?;
        }
        Ok(())
    }

    /// GC, where the plugin has it.
    pub fn gc(&self) -> CniResult<()> {
        if self.speaks_1_1 {
            self.run("GC", None)?;
        }
        Ok(())
    }

    fn name(&self) -> String {
        self.plugin.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned())
    }

    fn failed(&self, msg: String) -> CniError {
        CniError::new(code::IPAM_FAILED, format!("IPAM plugin {}: {msg}", self.name()))
    }

    /// Runs the plugin; its stdout on success, its error (code and all) on
    /// failure.
    fn run(&self, command: &str, attachment: Option<&Attachment>) -> CniResult<Vec<u8>> {
        let mut cmd = Command::new(&self.plugin);
        cmd.env("CNI_COMMAND", command).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        if let Some(a) = attachment {
            cmd.env("CNI_CONTAINERID", a.container_id).env("CNI_IFNAME", a.ifname);
            match a.netns {
                Some(ns) => cmd.env("CNI_NETNS", ns),
                None => cmd.env_remove("CNI_NETNS"),
            };
        }
        let out = exec(cmd, &self.stdin).map_err(|e| self.failed(format!("cannot run {}: {e}", self.plugin.display())))?;
        if out.status.success() {
            return Ok(out.stdout);
        }
        // The plugin's own CNI error, with its code, named as the IPAM's.
        match serde_json::from_slice::<Value>(&out.stdout) {
            Ok(e) if e.get("code").and_then(Value::as_u64).is_some() => {
                let text = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                Err(CniError::new(e["code"].as_u64().unwrap_or(0) as u32, format!("IPAM plugin {}: {}", self.name(), text("msg")))
                    .with_details(text("details")))
            }
            _ => Err(self.failed(format!(
                "{command} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stdout).trim()
            ))),
        }
    }
}

/// Runs `cmd` with `stdin` written to it.
fn exec(mut cmd: Command, stdin: &[u8]) -> std::io::Result<std::process::Output> {
    let mut child = cmd.spawn()?;
    // A plugin that exits without reading its input is its own business:
    // its exit status and output say what happened.
    let _ = child.stdin.take().expect("piped").write_all(stdin);
    child.wait_with_output()
}

/// The plugin `kind` in the first directory of `cni_path` that has it.
pub fn find_plugin(kind: &str, cni_path: &str) -> CniResult<PathBuf> {
    std::env::split_paths(cni_path)
        .filter(|d| !d.as_os_str().is_empty())
        .map(|d| d.join(kind))
        .find(|p| is_executable(p))
        .ok_or_else(|| {
            CniError::new(code::IPAM_FAILED, format!("IPAM plugin {kind} not found in CNI_PATH \"{cni_path}\""))
        })
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The versions the plugin says it speaks (VERSION); if it will not say,
/// assume it speaks the config's and let ADD tell.
fn supported_versions(plugin: &Path, ours: &str) -> Vec<String> {
    let mut cmd = Command::new(plugin);
    cmd.env("CNI_COMMAND", "VERSION").stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null());
    let stdin = serde_json::json!({ "cniVersion": ours }).to_string();
    exec(cmd, stdin.as_bytes())
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
        .and_then(|v| serde_json::from_value::<Vec<String>>(v.get("supportedVersions")?.clone()).ok())
        .unwrap_or_else(|| vec![ours.to_string()])
}

/// The version to give the plugin: the config's if it speaks it, else the
/// highest it speaks of the same major version below the config's.
pub fn negotiate(ours: &str, theirs: &[String]) -> Option<String> {
    if theirs.iter().any(|v| v == ours) {
        return Some(ours.to_string());
    }
    let o = version_tuple(ours)?;
    theirs
        .iter()
        .filter_map(|v| Some((version_tuple(v)?, v)))
        .filter(|(t, _)| t.0 == o.0 && *t < o)
        .max()
        .map(|(_, v)| v.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn negotiates_down_within_a_major_version() {
        let host_local = v(&["0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0"]);
        assert_eq!(negotiate("1.1.0", &host_local).as_deref(), Some("1.0.0"));
        assert_eq!(negotiate("1.0.0", &host_local).as_deref(), Some("1.0.0"));
        assert_eq!(negotiate("0.4.0", &host_local).as_deref(), Some("0.4.0"));
        assert_eq!(negotiate("1.1.0", &v(&["0.4.0"])), None, "0.x results are not 1.x results");
        assert_eq!(negotiate("1.0.0", &v(&["1.1.0"])), None, "never upward");
    }

    #[test]
    fn finds_plugins_along_the_path() {
        let dir = std::env::temp_dir().join(format!("vnet-cni-find-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("fake-ipam");
        std::fs::write(&p, "#!/bin/sh\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = format!("/nonexistent:{}", dir.display());
        assert_eq!(find_plugin("fake-ipam", &path).unwrap(), p);
        assert_eq!(find_plugin("other", &path).unwrap_err().code, code::IPAM_FAILED);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

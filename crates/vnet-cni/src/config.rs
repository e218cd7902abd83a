//! The plugin's input: the network configuration on stdin (checked field by
//! field, so an error names the key and the value) and the CNI_* variables.

use crate::error::{code, invalid_config, CniError, CniResult};
use crate::names;
use serde_json::{Map, Value};
use std::path::PathBuf;
use vnet_core::command::{MAX_MTU, MIN_MTU};
use vnet_core::Mac;

/// The CNI versions the plugin speaks.
pub const SUPPORTED_VERSIONS: [&str; 4] = ["0.3.1", "0.4.0", "1.0.0", "1.1.0"];
/// The version errors are reported in when the config's is unknown.
pub const LATEST_VERSION: &str = "1.1.0";

pub const DEFAULT_SOCKET: &str = "/run/vnetd.sock";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/cni/vnet";
/// A 1500-byte underlay less VNET's 42 bytes of encapsulation: frames the
/// kernel fast path can carry whole.
pub const DEFAULT_MTU: u32 = 1458;

/// `major.minor.patch`, for ordering versions.
pub fn version_tuple(v: &str) -> Option<(u32, u32, u32)> {
    let mut it = v.split('.').map(|p| p.parse::<u32>().ok());
    let t = (it.next()??, it.next()??, it.next()??);
    it.next().is_none().then_some(t)
}

/// Whether version `v` is at least `min` (false if either does not parse).
pub fn at_least(v: &str, min: &str) -> bool {
    matches!((version_tuple(v), version_tuple(min)), (Some(a), Some(b)) if a >= b)
}

/// Who routes frames to the container.
#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Routes {
    /// The plugin adds, with the interface, the two rules that deliver
    /// frames to it: unicast to its MAC and broadcast copies from anywhere.
    Local,
    /// vnet-agent derives every route from etcd; the plugin adds none.
    Agent,
}

/// A network configuration, as this plugin reads it.
#[derive(Clone, Debug)]
pub struct NetConf {
    pub cni_version: String,
    /// The CNI network's name.
    pub name: String,
    pub socket: PathBuf,
    /// The VNET network (`INTERFACE ADD ... network <n>`).
    pub network: String,
    pub mtu: u32,
    pub routes: Routes,
    pub state_dir: PathBuf,
    /// vnet-agent's list of the overlay's guests (`vnet-agent run
    /// --macs-file`): a MAC in it is not given to a container.
    pub macs_file: Option<PathBuf>,
    /// The IPAM plugin's type (a binary in CNI_PATH), if any.
    pub ipam: Option<String>,
    /// `runtimeConfig.mac` (the `mac` capability).
    pub runtime_mac: Option<Mac>,
    /// `dns` of the config, which goes into the result as the bridge
    /// plugin does it.
    pub dns: Option<Value>,
    pub prev_result: Option<Value>,
    /// GC: the still-valid attachments, (container id, ifname). `None`
    /// when the key is absent.
    pub valid_attachments: Option<Vec<(String, String)>>,
    /// The whole config as received, for the IPAM plugin.
    pub raw: Value,
}

/// Reads the config's JSON and its version alone (for VERSION and for the
/// version errors are reported in).
pub fn parse_json(stdin: &[u8]) -> CniResult<Value> {
    let v: Value = serde_json::from_slice(stdin)
        .map_err(|e| CniError::new(code::DECODING_FAILED, format!("the network config on stdin is not JSON: {e}")))?;
    if !v.is_object() {
        return Err(CniError::new(code::DECODING_FAILED, "the network config on stdin is not a JSON object"));
    }
    Ok(v)
}

/// The config's `cniVersion`, checked against the versions the plugin speaks.
pub fn checked_version(v: &Value) -> CniResult<String> {
    let incompatible = |msg: String| {
        CniError::new(code::INCOMPATIBLE_VERSION, msg)
            .with_details(format!("vnet-cni supports {}", SUPPORTED_VERSIONS.join(", ")))
    };
    match v.get("cniVersion") {
        Some(Value::String(s)) if SUPPORTED_VERSIONS.contains(&s.as_str()) => Ok(s.clone()),
        Some(Value::String(s)) => Err(incompatible(format!("incompatible CNI version: config is \"{s}\""))),
        Some(other) => Err(incompatible(format!("incompatible CNI version: cniVersion {other} is not a string"))),
        None => Err(incompatible("incompatible CNI version: the config has no cniVersion".into())),
    }
}

impl NetConf {
    /// Parses and checks the whole config: not JSON → 6, a version the
    /// plugin does not speak → 1, a bad value → 7, `ipMasq` → 2.
    pub fn parse(stdin: &[u8]) -> CniResult<NetConf> {
        let raw = parse_json(stdin)?;
        let cni_version = checked_version(&raw)?;
        let m = raw.as_object().expect("checked by parse_json");

        let name = string(m, "name")?.ok_or_else(|| invalid_config("the network config has no \"name\""))?;
        if !names::is_cni_name(&name) {
            return Err(invalid_config(format!(
                "network name \"{name}\" is invalid: it must start with a letter or digit, then letters, digits, '_', '.' or '-'"
            )));
        }
        let socket = match string(m, "socket")? {
            None => PathBuf::from(DEFAULT_SOCKET),
            Some(s) if s.starts_with('/') && s.len() <= 107 => PathBuf::from(s),
            Some(s) => return Err(invalid_config(format!("socket \"{s}\" is not an absolute path of at most 107 bytes"))),
        };
        let network = match string(m, "network")? {
            None => names::default_network(&name),
            Some(n) if names::is_plain_name(&n, 64) => n,
            Some(n) => {
                return Err(invalid_config(format!(
                    "network \"{n}\" is not a VNET network name (1-64 of A-Z a-z 0-9 _ . -)"
                )))
            }
        };
        let mtu = match m.get("mtu") {
            None => DEFAULT_MTU,
            Some(v) => match v.as_u64() {
                Some(n) if (MIN_MTU as u64..=MAX_MTU as u64).contains(&n) => n as u32,
                _ => return Err(invalid_config(format!("mtu {v} is not a number in {MIN_MTU}..{MAX_MTU}"))),
            },
        };
        let routes = match string(m, "routes")?.as_deref() {
            None | Some("local") => Routes::Local,
            Some("agent") => Routes::Agent,
            Some(r) => return Err(invalid_config(format!("routes \"{r}\" is unknown (want \"local\" or \"agent\")"))),
        };
        let state_dir = match string(m, "stateDir")? {
            None => PathBuf::from(DEFAULT_STATE_DIR),
            Some(s) if s.starts_with('/') => PathBuf::from(s),
            Some(s) => return Err(invalid_config(format!("stateDir \"{s}\" is not an absolute path"))),
        };
        let macs_file = match string(m, "macsFile")? {
            None => None,
            Some(s) if s.starts_with('/') => Some(PathBuf::from(s)),
            Some(s) => return Err(invalid_config(format!("macsFile \"{s}\" is not an absolute path"))),
        };
        let ipam = match m.get("ipam") {
            None | Some(Value::Null) => None,
            Some(Value::Object(i)) => match string(i, "type")? {
                None => None,
                Some(t) if names::is_plain_name(&t, 255) && !t.starts_with('.') => Some(t),
                Some(t) => return Err(invalid_config(format!("ipam type \"{t}\" is not a plugin's file name"))),
            },
            Some(other) => return Err(invalid_config(format!("ipam {other} is not an object"))),
        };
        if let Some(v) = m.get("ipMasq").filter(|v| **v != Value::Bool(false)) {
            return Err(CniError::new(
                code::UNSUPPORTED_FIELD,
                format!("unsupported field ipMasq: {v} (vnet-cni puts containers on an overlay LAN and masquerades nothing)"),
            ));
        }
        let runtime_mac = match m.get("runtimeConfig").and_then(|r| r.get("mac")) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(unicast_mac(s).map_err(|e| invalid_config(format!("runtimeConfig mac: {e}")))?),
            Some(other) => return Err(invalid_config(format!("runtimeConfig mac {other} is not a string"))),
        };
        let dns = m.get("dns").filter(|d| d.as_object().is_some_and(|o| !o.is_empty())).cloned();
        let prev_result = m.get("prevResult").filter(|v| !v.is_null()).cloned();
        // "cni.dev/attachments" is the name an earlier text of the spec
        // used; libcni sends both.
        let valid_attachments = match m.get("cni.dev/valid-attachments").or_else(|| m.get("cni.dev/attachments")) {
            None | Some(Value::Null) => None,
            Some(v) => Some(attachments(v)?),
        };
        Ok(NetConf { cni_version, name, socket, network, mtu, routes, state_dir, macs_file, ipam, runtime_mac, dns, prev_result, valid_attachments, raw })
    }
}

/// A string field, `None` when absent; any other type is an error.
fn string(m: &Map<String, Value>, key: &str) -> CniResult<Option<String>> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(invalid_config(format!("{key} {other} is not a string"))),
    }
}

fn attachments(v: &Value) -> CniResult<Vec<(String, String)>> {
    let bad = || {
        CniError::new(
            code::DECODING_FAILED,
            format!("cni.dev/valid-attachments {v} is not a list of {{\"containerID\", \"ifname\"}}"),
        )
    };
    let list = v.as_array().ok_or_else(bad)?;
    list.iter()
        .map(|a| {
            let id = a.get("containerID").and_then(Value::as_str).ok_or_else(bad)?;
            let ifname = a.get("ifname").and_then(Value::as_str).ok_or_else(bad)?;
            Ok((id.to_string(), ifname.to_string()))
        })
        .collect()
}

/// A guest MAC: any unicast address (vnetd refuses multicast ones).
pub fn unicast_mac(s: &str) -> Result<Mac, String> {
    let mac: Mac = s.parse()?;
    if mac.is_multicast() {
        return Err(format!("{mac} is a multicast address; a container's MAC must be unicast"));
    }
    Ok(mac)
}

/// The CNI_* variables of one invocation.
#[derive(Clone, Debug, Default)]
pub struct CniEnv {
    pub container_id: String,
    pub netns: Option<String>,
    pub ifname: String,
    /// CNI_ARGS, `K=V;K=V`.
    pub args: Vec<(String, String)>,
}

impl CniEnv {
    /// Reads the variables `command` needs (through `get`, the process
    /// environment in use): ADD and CHECK need the container ID, the netns
    /// and the interface name, DEL all but the netns, STATUS and GC none.
    pub fn read(command: &str, get: impl Fn(&str) -> Option<String>) -> CniResult<CniEnv> {
        let get = |k: &str| get(k).filter(|v| !v.is_empty());
        let needed: &[&str] = match command {
            "ADD" | "CHECK" => &["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"],
            "DEL" => &["CNI_CONTAINERID", "CNI_IFNAME"],
            _ => &[],
        };
        let missing: Vec<&str> = needed.iter().copied().filter(|k| get(k).is_none()).collect();
        if !missing.is_empty() {
            return Err(CniError::new(code::INVALID_ENV, format!("required env variables [{}] missing", missing.join(" "))));
        }
        let mut env = CniEnv { netns: get("CNI_NETNS"), ..CniEnv::default() };
        if needed.is_empty() {
            return Ok(env);
        }
        env.container_id = get("CNI_CONTAINERID").expect("checked above");
        if !names::is_cni_name(&env.container_id) {
            return Err(CniError::new(
                code::INVALID_ENV,
                format!("CNI_CONTAINERID \"{}\" has invalid characters", env.container_id),
            ));
        }
        env.ifname = get("CNI_IFNAME").expect("checked above");
        vnet_core::command::check_ifname(&env.ifname)
            .map_err(|e| CniError::new(code::INVALID_ENV, format!("CNI_IFNAME: {e}")))?;
        if let Some(args) = get("CNI_ARGS") {
            env.args = parse_args(&args)?;
        }
        Ok(env)
    }

    /// A CNI_ARGS value by key.
    pub fn arg(&self, key: &str) -> Option<&str> {
        self.args.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// `K=V;K=V` (an empty pair, from a trailing `;`, is skipped).
pub fn parse_args(s: &str) -> CniResult<Vec<(String, String)>> {
    s.split(';')
        .filter(|p| !p.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(CniError::new(code::INVALID_ENV, format!("CNI_ARGS: \"{pair}\" is not KEY=VALUE"))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn conf(text: &str) -> CniResult<NetConf> {
        NetConf::parse(text.as_bytes())
    }

    #[test]
    fn a_minimal_config_takes_the_defaults() {
        let c = conf(r#"{"cniVersion":"1.0.0","name":"vnet-blue","type":"vnet-cni"}"#).unwrap();
        assert_eq!(c.socket, PathBuf::from("/run/vnetd.sock"));
        assert_eq!(c.network, "vnet-blue", "the CNI network's name");
        assert_eq!(c.mtu, 1458);
        assert_eq!(c.routes, Routes::Local);
        assert_eq!(c.state_dir, PathBuf::from("/var/lib/cni/vnet"));
        assert_eq!(c.ipam, None);
        assert!(c.runtime_mac.is_none() && c.prev_result.is_none() && c.valid_attachments.is_none());
    }

    #[test]
    fn every_field_is_read() {
        let c = conf(
            r#"{"cniVersion":"0.4.0","name":"n","type":"vnet-cni","socket":"/tmp/v.sock","network":"blue",
                "mtu":9000,"routes":"agent","stateDir":"/tmp/st","ipam":{"type":"host-local","subnet":"10.1.0.0/24"},
                "runtimeConfig":{"mac":"0A:00:00:00:00:01"},"dns":{"nameservers":["10.1.0.1"]},
                "prevResult":{"cniVersion":"0.4.0"},"cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}]}"#,
        )
        .unwrap();
        assert_eq!((c.socket.to_str().unwrap(), c.network.as_str(), c.mtu), ("/tmp/v.sock", "blue", 9000));
        assert_eq!(c.routes, Routes::Agent);
        assert_eq!(c.ipam.as_deref(), Some("host-local"));
        assert_eq!(c.runtime_mac.unwrap().to_string(), "0a:00:00:00:00:01");
        assert!(c.dns.is_some() && c.prev_result.is_some());
        assert_eq!(c.valid_attachments, Some(vec![("a".to_string(), "eth0".to_string())]));
    }

    #[test]
    fn bad_configs_get_the_specs_codes() {
        let code_of = |t: &str| conf(t).unwrap_err().code;
        assert_eq!(code_of("{not json"), 6);
        assert_eq!(code_of("[1,2]"), 6);
        assert_eq!(code_of(r#"{"name":"n"}"#), 1, "no cniVersion");
        assert_eq!(code_of(r#"{"cniVersion":"0.2.0","name":"n"}"#), 1);
        assert_eq!(code_of(r#"{"cniVersion":"1.0.0"}"#), 7, "no name");
        assert_eq!(code_of(r#"{"cniVersion":"1.0.0","name":"-x"}"#), 7);
        for bad in [
            r#""routes":"bgp""#,
            r#""routes":1"#,
            r#""mtu":"big""#,
            r#""mtu":67"#,
            r#""mtu":65522"#,
            r#""mtu":-1"#,
            r#""socket":"run/v.sock""#,
            r#""network":"a b""#,
            r#""stateDir":"rel""#,
            r#""ipam":{"type":"../x"}"#,
            r#""runtimeConfig":{"mac":"01:00:5e:00:00:01"}"#,
            r#""runtimeConfig":{"mac":"nope"}"#,
        ] {
            let e = conf(&format!(r#"{{"cniVersion":"1.0.0","name":"n",{bad}}}"#)).unwrap_err();
            assert_eq!(e.code, 7, "{bad}: {e}");
        }
        let e = conf(r#"{"cniVersion":"1.0.0","name":"n","routes":"bgp"}"#).unwrap_err();
        assert!(e.msg.contains("routes") && e.msg.contains("bgp"), "the key and the value: {}", e.msg);
        let e = conf(r#"{"cniVersion":"1.0.0","name":"n","ipMasq":true}"#).unwrap_err();
        assert_eq!(e.code, 2);
        assert!(e.msg.contains("ipMasq"));
        assert_eq!(code_of(r#"{"cniVersion":"1.1.0","name":"n","cni.dev/valid-attachments":[{"id":1}]}"#), 6);
    }

    #[test]
    fn versions_order() {
        assert!(at_least("1.1.0", "1.0.0") && at_least("0.4.0", "0.4.0") && !at_least("0.3.1", "0.4.0"));
        assert!(!at_least("x", "0.4.0"));
        assert_eq!(version_tuple("1.2.3"), Some((1, 2, 3)));
        assert_eq!(version_tuple("1.2"), None);
    }

    #[test]
    fn environment_per_command() {
        let env = |pairs: &[(&str, &str)]| {
            let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            move |k: &str| m.get(k).cloned()
        };
        let full = [("CNI_CONTAINERID", "abc"), ("CNI_NETNS", "/run/netns/x"), ("CNI_IFNAME", "eth0"), ("CNI_ARGS", "IgnoreUnknown=1;MAC=02:00:00:00:00:09")];
        let e = CniEnv::read("ADD", env(&full)).unwrap();
        assert_eq!((e.container_id.as_str(), e.netns.as_deref(), e.ifname.as_str()), ("abc", Some("/run/netns/x"), "eth0"));
        assert_eq!(e.arg("MAC"), Some("02:00:00:00:00:09"));
        let err = CniEnv::read("ADD", env(&full[..1])).unwrap_err();
        assert_eq!(err.code, 4);
        assert!(err.msg.contains("CNI_NETNS") && err.msg.contains("CNI_IFNAME"), "{}", err.msg);
        // DEL does without the netns; GC and STATUS without any.
        assert!(CniEnv::read("DEL", env(&[full[0], full[2]])).is_ok());
        assert!(CniEnv::read("GC", env(&[])).is_ok());
        assert_eq!(CniEnv::read("DEL", env(&[("CNI_CONTAINERID", "a/b"), full[2]])).unwrap_err().code, 4);
        assert_eq!(CniEnv::read("DEL", env(&[full[0], ("CNI_IFNAME", "a name")])).unwrap_err().code, 4);
        assert_eq!(CniEnv::read("DEL", env(&[full[0], full[2], ("CNI_ARGS", "novalue")])).unwrap_err().code, 4);
    }
}

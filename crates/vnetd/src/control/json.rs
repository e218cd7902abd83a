//! Replies as JSON, for sessions that asked with `FORMAT json`.
//!
//! The text replies are lines of `kind [id] key=value ...`; the JSON reply
//! is the same records with the same names, so a script reads what a person
//! reads. One reply is one line:
//!
//! ```text
//! {"ok":true,"records":[{"kind":"interface","id":0,"name":"g1",...},...]}
//! {"ok":false,"error":"line 1: no interface g9: INTERFACE DEL g9"}
//! ```
//!
//! How a text line becomes a record:
//! - its first word is `kind`; a number after it is `id`;
//! - `key=value` words are fields: a value of digits (or digits, a point and
//!   digits) is a number, except under keys that name things (a link or
//!   network may be called `42`), which stay strings; `rule=` takes the rest
//!   of the line (a rule has spaces);
//! - a route's listing (`route <id> <rule...> [owner <tag>]`) gives `rule`
//!   and `owner`;
//! - a change's confirmation (`added interface 2 g1 ...`, `deleted route 4
//!   ...`) gives `kind: "change"`, `verb`, `object`, `id`, `name` (or `rule`
//!   for a route) and the whole line as `text`;
//! - other lone words are `name` when there is one and no `name=`, else
//!   `args`; `HELP`'s lines are `{"kind":"help","text":...}`.

use serde_json::{Map, Number, Value};

/// Keys whose values are names or addresses: never numbers.
const STRING_KEYS: &[&str] = &["name", "netns", "network", "ifname", "host", "owner", "socket", "cgroup", "remote", "mac", "rule"];

/// The one-line JSON reply to a request.
pub fn reply(result: &Result<Vec<String>, String>, help: bool) -> String {
    let v = match result {
        Ok(lines) => {
            let records: Vec<Value> = if help {
                lines.iter().map(|l| serde_json::json!({"kind": "help", "text": l})).collect()
            } else {
                lines.iter().map(|l| Value::Object(record(l))).collect()
            };
            serde_json::json!({"ok": true, "records": records})
        }
        Err(e) => error_value(e),
    };
    v.to_string()
}

/// The one-line JSON reply for an error.
pub fn error(msg: &str) -> String {
    error_value(msg).to_string()
}

fn error_value(msg: &str) -> Value {
    serde_json::json!({"ok": false, "error": msg})
}

fn typed(key: &str, v: &str) -> Value {
    if !STRING_KEYS.contains(&key) {
        if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(n) = v.parse::<u64>() {
                return Value::Number(n.into());
            }
        }
        if let Some((a, b)) = v.split_once('.') {
            let digits = |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit());
            if digits(a) && digits(b) {
                if let Some(n) = v.parse::<f64>().ok().and_then(Number::from_f64) {
                    return Value::Number(n);
                }
            }
        }
    }
    Value::String(v.to_string())
}

/// A `key=value` word, with a key of lowercase letters, digits, `_` and `-`.
fn field(word: &str) -> Option<(&str, &str)> {
    let (k, v) = word.split_once('=')?;
    let ok = !k.is_empty() && k.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    ok.then_some((k, v))
}

/// One text line as a record.
pub fn record(line: &str) -> Map<String, Value> {
    let mut m = Map::new();
    let words: Vec<&str> = line.split(' ').filter(|w| !w.is_empty()).collect();
    let Some((&kind, mut rest)) = words.split_first() else {
        return m;
    };
    if matches!(kind, "added" | "deleted" | "detached") {
        return change(line, &words);
    }
    m.insert("kind".into(), kind.into());
    if let Some((id, r)) = rest.split_first() {
        if let Ok(id) = id.parse::<u64>() {
            m.insert("id".into(), id.into());
            rest = r;
        }
    }
    let mut loose = Vec::new();
    for (i, w) in rest.iter().enumerate() {
        match field(w) {
            Some(("rule", v)) => {
                let tail = std::iter::once(v).chain(rest[i + 1..].iter().copied()).collect::<Vec<_>>().join(" ");
                m.insert("rule".into(), tail.into());
                break;
            }
            Some((k, v)) => {
                m.insert(k.into(), typed(k, v));
            }
            None => loose.push(*w),
        }
    }
    if loose.is_empty() {
        return m;
    }
    if kind == "route" {
        // `route <id> <rule...> [owner <tag>]`
        let (rule, owner) = match loose.iter().position(|w| *w == "owner") {
            Some(p) => (&loose[..p], loose.get(p + 1).copied()),
            None => (&loose[..], None),
        };
        m.insert("rule".into(), rule.join(" ").into());
        if let Some(o) = owner {
            m.insert("owner".into(), o.into());
        }
    } else if loose.len() == 1 && !m.contains_key("name") {
        m.insert("name".into(), loose[0].into());
    } else {
        m.insert("args".into(), loose.into_iter().map(Value::from).collect());
    }
    m
}

/// `added interface 2 g1 02:.. mtu 1500 veth`, `deleted route 4 <rule>`, ...
fn change(line: &str, words: &[&str]) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("kind".into(), "change".into());
    m.insert("verb".into(), words[0].into());
    if let Some(object) = words.get(1) {
        m.insert("object".into(), (*object).into());
    }
    if let Some(id) = words.get(2).and_then(|w| w.parse::<u64>().ok()) {
        m.insert("id".into(), id.into());
        if words[1] == "route" {
            m.insert("rule".into(), words[3..].join(" ").into());
        } else if let Some(name) = words.get(3) {
            m.insert("name".into(), (*name).into());
        }
    }
    m.insert("text".into(), line.into());
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rec(line: &str) -> Value {
        Value::Object(record(line))
    }

    #[test]
    fn fields_keep_their_names_and_counters_are_numbers() {
        assert_eq!(
            rec("link 1 name=42 in_frames=7 rx_batch_mean=1.5 vni=42 remote=127.0.0.3:9100 path=kernel"),
            json!({"kind":"link","id":1,"name":"42","in_frames":7,"rx_batch_mean":1.5,"vni":42,"remote":"127.0.0.3:9100","path":"kernel"})
        );
        assert_eq!(rec("paths user_frames=3 kernel_frames=0"), json!({"kind":"paths","user_frames":3,"kernel_frames":0}));
        // A version is not a number; hex stays text.
        assert_eq!(rec("vnetd version=0.1.0 x=0x3f"), json!({"kind":"vnetd","version":"0.1.0","x":"0x3f"}));
    }

    #[test]
    fn rules_with_spaces_stay_whole() {
        assert_eq!(
            rec("route 2 frames=5 bytes=9 fast_frames=0 rule=any ff:ff:ff:ff:ff:ff edge 127.0.0.2 interface"),
            json!({"kind":"route","id":2,"frames":5,"bytes":9,"fast_frames":0,"rule":"any ff:ff:ff:ff:ff:ff edge 127.0.0.2 interface"})
        );
        assert_eq!(
            rec("route 2 any ff:ff:ff:ff:ff:ff edge 127.0.0.2 interface owner agent"),
            json!({"kind":"route","id":2,"rule":"any ff:ff:ff:ff:ff:ff edge 127.0.0.2 interface","owner":"agent"})
        );
        assert_eq!(rec("route 0 any 02:00:00:00:00:01 interface 02:00:00:00:00:01 any")["rule"], "any 02:00:00:00:00:01 interface 02:00:00:00:00:01 any");
    }

    #[test]
    fn changes_say_what_changed() {
        assert_eq!(
            rec("added interface 2 c1 02:00:00:00:00:09 mtu 1500 veth"),
            json!({"kind":"change","verb":"added","object":"interface","id":2,"name":"c1","text":"added interface 2 c1 02:00:00:00:00:09 mtu 1500 veth"})
        );
        assert_eq!(rec("deleted route 4 any 02:00:00:00:00:01 interface 02:00:00:00:00:01 any")["rule"], "any 02:00:00:00:00:01 interface 02:00:00:00:00:01 any");
        assert_eq!(rec("interface 2 zzt2 mode=vmm-driven"), json!({"kind":"interface","id":2,"name":"zzt2","mode":"vmm-driven"}));
        assert_eq!(rec("vtoe enabled=no"), json!({"kind":"vtoe","enabled":"no"}));
        assert_eq!(rec("ab c d"), json!({"kind":"ab","args":["c","d"]}));
    }

    #[test]
    fn replies_are_one_line_of_json() {
        let ok = reply(&Ok(vec!["global in_frames=1".into()]), false);
        assert!(!ok.contains('\n'));
        let v: Value = serde_json::from_str(&ok).unwrap();
        assert_eq!(v, json!({"ok":true,"records":[{"kind":"global","in_frames":1}]}));
        let err: Value = serde_json::from_str(&reply(&Err("line 1: no \"x\"\n".into()), false)).unwrap();
        assert_eq!(err, json!({"ok":false,"error":"line 1: no \"x\"\n"}));
        let help: Value = serde_json::from_str(&reply(&Ok(vec!["ROUTE LIST".into()]), true)).unwrap();
        assert_eq!(help["records"][0], json!({"kind":"help","text":"ROUTE LIST"}));
    }
}

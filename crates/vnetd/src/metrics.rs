//! `--metrics <addr:port>`: vnetd's counters for Prometheus, as OpenMetrics
//! text at `/metrics` (prometheus-client encodes; tiny_http serves).
//!
//! Nothing is counted for this: a scrape reads the counters `STATS` reads,
//! through the same reports, so a metric and its STATS field are the same
//! number, and the per-frame path pays nothing. The names follow from the
//! STATS lines (docs/metrics.md):
//!
//! - a field `f` of a line `kind ...` is `vnet_<kind>_<f>` (`_total` for a
//!   counter): `vnet_global_in_frames_total`, `vnet_dispatch_wakeups_total`,
//!   `vnet_fastpath_installs_total`, `vnet_vtoe_offers_total`, ...;
//! - per interface and per link, labelled by name (`interface="g1"`,
//!   `link="198.18.0.2"`): `vnet_interface_in_bytes_total{interface="g1"}`;
//! - `drop_<reason>` fields are one family with a `reason` label:
//!   `vnet_interface_drops_total{interface="g1",reason="no_route"}`;
//! - yes/no fields are 0/1 gauges (`vnet_fastpath_enabled`), an interface's
//!   modes are `vnet_interface_mode{interface,configured,running} 1`, and
//!   `vnet_build_info{version}` is 1 (an OpenMetrics info).
//!
//! Labels stay bounded: interfaces, links and drop reasons, never routes or
//! connections (`vnet_routes` and `vnet_vtoe_open` count those).

use crate::control::access::{Caller, Role};
use crate::control::{json, Control};
use anyhow::Result;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

/// STATS fields that are levels, not counts, though whole numbers (every
/// fraction, a mean or a ratio, is a level too).
const GAUGES: &[&str] = &["entries", "cache_entries", "open", "listeners", "next_hops", "peers", "handshakes_waiting"];
/// The request a scrape makes (routes are counted, not listed).
const REQUEST: &str = "STATS global\nSTATS interfaces\nSTATS links\nSTATS vtoe";

/// Binds `addr` (before anything runs, as vnetd's other sockets are).
pub fn bind(addr: SocketAddr) -> Result<tiny_http::Server> {
    tiny_http::Server::http(addr).map_err(|e| anyhow::anyhow!("cannot bind --metrics {addr}: {e}"))
}

/// Serves `/metrics` from a thread of its own.
pub fn spawn(ctl: Arc<Control>, server: tiny_http::Server) -> Result<()> {
    let addr = server.server_addr();
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Collector { ctl }));
    std::thread::Builder::new().name("metrics".into()).spawn(move || {
        for req in server.incoming_requests() {
            let path = req.url().split('?').next().unwrap_or("");
            let resp = match (req.method(), path) {
                (tiny_http::Method::Get, "/metrics") => {
                    let mut body = String::new();
                    match prometheus_client::encoding::text::encode(&mut body, &registry) {
                        Ok(()) => tiny_http::Response::from_string(body).with_header(header(
                            "Content-Type",
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )),
                        Err(_) => tiny_http::Response::from_string("cannot encode the metrics\n").with_status_code(500),
                    }
                }
                (tiny_http::Method::Get, "/") => tiny_http::Response::from_string("vnetd: metrics at /metrics\n"),
                (tiny_http::Method::Get, _) => tiny_http::Response::from_string("not found: try /metrics\n").with_status_code(404),
                _ => tiny_http::Response::from_string("only GET\n").with_status_code(405),
            };
            if let Err(e) = req.respond(resp) {
                tracing::debug!("metrics: reply not sent: {e}");
            }
        }
    })?;
    tracing::info!("metrics at http://{addr}/metrics");
    Ok(())
}

fn header(k: &str, v: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(k.as_bytes(), v.as_bytes()).expect("a valid header")
}

struct Collector {
    ctl: Arc<Control>,
}

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("vnetd's STATS")
    }
}

/// A sample's value: counts are integers, and stay exact past 2^53.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Num {
    Int(u64),
    Float(f64),
}

/// One metric family being gathered: its type and its samples.
#[derive(Default)]
struct Family {
    gauge: bool,
    /// Where it comes from in STATS.
    help: String,
    samples: Vec<(Vec<(String, String)>, Num)>,
}

/// The samples of one scrape, by metric name (without `_total`).
#[derive(Default)]
pub struct Gathered(BTreeMap<String, Family>);

impl Gathered {
    fn add(&mut self, name: String, help: String, gauge: bool, labels: Vec<(String, String)>, v: Num) {
        let f = self.0.entry(name).or_default();
        f.gauge = gauge;
        f.help = help;
        f.samples.push((labels, v));
    }

    /// Adds one STATS record's numbers.
    pub fn record(&mut self, r: &Map<String, Value>) {
        let kind = r.get("kind").and_then(Value::as_str).unwrap_or("");
        if kind.is_empty() || kind == "vtoe_conn" || kind == "route" {
            return;
        }
        let mut base = Vec::new();
        if matches!(kind, "interface" | "link") {
            let name = r.get("name").and_then(Value::as_str).unwrap_or("");
            base.push((kind.to_string(), name.to_string()));
        }
        if kind == "interface" {
            let s = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("").to_string();
            let mut labels = base.clone();
            labels.push(("configured".into(), s("mode")));
            labels.push(("running".into(), s("running")));
            let help = "STATS interfaces: mode (configured) and running (the mode in force now)".to_string();
            self.add("vnet_interface_mode".into(), help, true, labels, Num::Int(1));
        }
        for (k, v) in r {
            let value = match v {
                Value::Number(n) => n.as_u64().map(Num::Int).unwrap_or(Num::Float(n.as_f64().unwrap_or(0.0))),
                Value::String(s) if s == "yes" => Num::Int(1),
                Value::String(s) if s == "no" => Num::Int(0),
                _ => continue,
            };
            if k == "id" {
                continue;
            }
            let yes_no = v.is_string();
            let name = k.replace('-', "_");
            match name.strip_prefix("drop_") {
                Some(reason) => {
                    let mut labels = base.clone();
                    labels.push(("reason".into(), reason.to_string()));
                    let help = format!("STATS: {kind} drop_<reason>");
                    self.add(format!("vnet_{kind}_drops"), help, false, labels, value);
                }
                None => {
                    let help = format!("STATS: {kind} {k}{}", if yes_no { " (yes 1, no 0)" } else { "" });
                    let level = yes_no || matches!(value, Num::Float(_)) || GAUGES.contains(&k.as_str());
                    self.add(format!("vnet_{kind}_{name}"), help, level, base.clone(), value)
                }
            }
        }
    }

    fn encode(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, f) in &self.0 {
            let kind = if f.gauge { MetricType::Gauge } else { MetricType::Counter };
            let mut m = encoder.encode_descriptor(name, &f.help, None, kind)?;
            for (labels, v) in &f.samples {
                let fam = m.encode_family(labels)?;
                match (f.gauge, *v) {
                    (false, Num::Int(n)) => ConstCounter::new(n).encode(fam)?,
                    (false, Num::Float(x)) => ConstCounter::new(x).encode(fam)?,
                    (true, Num::Int(n)) => ConstGauge::new(n as i64).encode(fam)?,
                    (true, Num::Float(x)) => ConstGauge::new(x).encode(fam)?,
                }
            }
        }
        let version = [("version".to_string(), env!("CARGO_PKG_VERSION").to_string())];
        let mut m = encoder.encode_descriptor("vnet_build", "vnetd's version", None, MetricType::Info)?;
        m.encode_info(&version)?;
        Ok(())
    }
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let caller = Caller { role: Role::Read, who: "metrics".into() };
        let Ok(lines) = self.ctl.execute(REQUEST, &caller) else {
            return Ok(());
        };
        let mut g = Gathered::default();
        for l in &lines {
            g.record(&json::record(l));
        }
        g.add("vnet_routes".into(), "routes in the rule table (ROUTE LIST)".into(), true, vec![], Num::Int(self.ctl.route_count() as u64));
        g.encode(&mut encoder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl std::fmt::Debug for Gathered {
        fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("Gathered")
        }
    }

    #[test]
    fn counts_are_counters_and_levels_fractions_and_yes_no_are_gauges() {
        let mut g = Gathered::default();
        g.record(&json::record(
            "interface 3 name=vm1 mode=adaptive running=vmm-driven in_frames=7 drop_no_route=2 vhost_rx_interrupts_per_frame=0.250 vhost_features=0x3",
        ));
        g.record(&json::record("fastpath loaded=yes enabled=no entries=5 installs=9"));
        g.record(&json::record("route 0 frames=1 bytes=2 rule=any any edge x any"));
        let fam = |n: &str| g.0.get(n).map(|f| (f.gauge, f.samples.clone()));
        let vm1 = vec![("interface".to_string(), "vm1".to_string())];
        assert_eq!(fam("vnet_interface_in_frames"), Some((false, vec![(vm1.clone(), Num::Int(7))])));
        let mut reason = vm1.clone();
        reason.push(("reason".into(), "no_route".into()));
        assert_eq!(fam("vnet_interface_drops"), Some((false, vec![(reason, Num::Int(2))])));
        assert_eq!(fam("vnet_interface_vhost_rx_interrupts_per_frame"), Some((true, vec![(vm1.clone(), Num::Float(0.25))])));
        assert!(fam("vnet_interface_vhost_features").is_none(), "hex is not a number");
        assert!(fam("vnet_interface_id").is_none());
        assert_eq!(fam("vnet_fastpath_enabled"), Some((true, vec![(vec![], Num::Int(0))])));
        assert_eq!(fam("vnet_fastpath_entries").map(|f| f.0), Some(true));
        assert_eq!(fam("vnet_fastpath_installs").map(|f| f.0), Some(false));
        // No per-route series.
        assert!(g.0.keys().all(|k| !k.starts_with("vnet_route_")));
        let mut text = String::new();
        let mut reg = Registry::default();
        #[derive(Debug)]
        struct Fixed(std::sync::Mutex<Option<Gathered>>);
        impl prometheus_client::collector::Collector for Fixed {
            fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
                self.0.lock().unwrap().as_ref().unwrap().encode(&mut e)
            }
        }
        reg.register_collector(Box::new(Fixed(std::sync::Mutex::new(Some(g)))));
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(text.contains("vnet_interface_in_frames_total{interface=\"vm1\"} 7\n"), "{text}");
        assert!(text.contains("# TYPE vnet_interface_vhost_rx_interrupts_per_frame gauge\n"), "{text}");
        assert!(text.contains("vnet_build_info{version="), "{text}");
    }
}

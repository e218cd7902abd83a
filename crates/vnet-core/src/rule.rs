//! Route rules as the user writes them: the VNET/P grammar
//! `src-MAC dst-MAC dst-TYPE dst-ID src-TYPE [src-ID]`, parsed and printed.
//!
//! A `RuleSpec` names its endpoints the way the user does (an interface by its
//! MAC, an edge by its link name); the daemon resolves those names to ports
//! before the rule reaches the matcher (`table::Rule`).

use crate::mac::Mac;
use std::fmt;
use std::net::IpAddr;

/// How one side (source or destination) of a rule matches a frame's MAC.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum MacQual {
    /// Exactly this address.
    Addr(Mac),
    /// Every address.
    Any,
    /// Only as a destination: "no destination given", which makes the rule a
    /// default route for its (exact) source MAC.
    None,
    /// Every address but this one.
    Not(Mac),
}

impl MacQual {
    pub fn parse(tok: &str) -> Result<MacQual, String> {
        let lower = tok.to_ascii_lowercase();
        match lower.as_str() {
            "any" => Ok(MacQual::Any),
            "none" => Ok(MacQual::None),
            _ => match lower.strip_prefix("not-") {
                Some(rest) => Ok(MacQual::Not(rest.parse()?)),
                None => Ok(MacQual::Addr(lower.parse().map_err(|_| {
                    format!("'{tok}' is not a MAC qualifier (want a MAC, any, none or not-<MAC>)")
                })?)),
            },
        }
    }
}

impl fmt::Display for MacQual {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MacQual::Addr(m) => write!(f, "{m}"),
            MacQual::Any => f.write_str("any"),
            MacQual::None => f.write_str("none"),
            MacQual::Not(m) => write!(f, "not-{m}"),
        }
    }
}

/// Where a rule sends a frame.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum DstSpec {
    /// A local virtual NIC, named by its registered (guest) MAC.
    Interface(Mac),
    /// A link to a remote host, named by the link's name (by default its remote IP).
    Edge(String),
}

/// Which origins a rule accepts frames from.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum SrcSpec {
    Any,
    /// From a local interface: the one with this MAC, or any.
    Interface(Option<Mac>),
    /// From a link: the one with this name, or any.
    Edge(Option<String>),
}

#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct RuleSpec {
    pub src_mac: MacQual,
    pub dst_mac: MacQual,
    pub dst: DstSpec,
    pub src: SrcSpec,
}

impl RuleSpec {
    /// Whether the rule names `mac`: as its source or destination MAC
    /// (exactly, or as the one a `not-` excludes), or as the interface at
    /// either end (`ROUTE LIST <MAC>`).
    pub fn names(&self, mac: Mac) -> bool {
        let q = |m: &MacQual| matches!(m, MacQual::Addr(a) | MacQual::Not(a) if *a == mac);
        q(&self.src_mac) || q(&self.dst_mac) || self.dst == DstSpec::Interface(mac) || self.src == SrcSpec::Interface(Some(mac))
    }
}

/// Link names are what `edge` ids refer to. An IP address is written in its
/// canonical form so that `edge 10.0.0.1` and `edge 010.0.0.1`-style spellings
/// cannot name two different links.
pub fn canonical_link_name(tok: &str) -> Result<String, String> {
    if let Ok(ip) = tok.parse::<IpAddr>() {
        return Ok(ip.to_string());
    }
    let ok = !tok.is_empty()
        && tok.len() <= 64
        && tok.chars().all(|c| c.is_ascii_alphanumeric() || "_.-:".contains(c))
        && tok.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    if ok {
        Ok(tok.to_string())
    } else {
        Err(format!("'{tok}' is not a link name (an IP address, or up to 64 of A-Z a-z 0-9 _ . - :)"))
    }
}

impl RuleSpec {
    /// Parses the tokens after `ROUTE ADD`:
    /// `src-MAC dst-MAC dst-TYPE dst-ID src-TYPE [src-ID]`.
    pub fn parse(toks: &[&str]) -> Result<RuleSpec, String> {
        const USAGE: &str = "want: src-MAC dst-MAC interface|edge dst-ID any|interface|edge [src-ID]";
        if toks.len() < 5 {
            return Err(format!("route rule is too short ({USAGE})"));
        }
        if toks.len() > 6 {
            return Err(format!("route rule has {} words, at most 6 ({USAGE})", toks.len()));
        }
        let src_mac = MacQual::parse(toks[0])?;
        let dst_mac = MacQual::parse(toks[1])?;
        let dst = match toks[2].to_ascii_lowercase().as_str() {
            "interface" | "if" => DstSpec::Interface(
                toks[3].parse().map_err(|e| format!("destination interface id: {e}"))?,
            ),
            "edge" | "link" => DstSpec::Edge(canonical_link_name(toks[3])?),
            other => return Err(format!("'{other}' is not a destination type (want interface or edge)")),
        };
        let src_id = toks.get(5).copied();
        let src = match toks[4].to_ascii_lowercase().as_str() {
            "any" => {
                if let Some(id) = src_id {
                    return Err(format!("source type any takes no id, but '{id}' follows it"));
                }
                SrcSpec::Any
            }
            "interface" | "if" => SrcSpec::Interface(
                src_id
                    .map(|t| t.parse::<Mac>().map_err(|e| format!("source interface id: {e}")))
                    .transpose()?,
            ),
            "edge" | "link" => SrcSpec::Edge(src_id.map(canonical_link_name).transpose()?),
            other => return Err(format!("'{other}' is not a source type (want any, interface or edge)")),
        };
        // Rules that can never match are refused rather than silently kept.
        if src_mac == MacQual::None {
            return Err("src-MAC none never matches: none is only a destination (the per-source default route)".into());
        }
        if dst_mac == MacQual::None && !matches!(src_mac, MacQual::Addr(_)) {
            return Err("dst-MAC none (a default route) needs an exact src-MAC".into());
        }
        Ok(RuleSpec { src_mac, dst_mac, dst, src })
    }
}

impl fmt::Display for RuleSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} ", self.src_mac, self.dst_mac)?;
        match &self.dst {
            DstSpec::Interface(m) => write!(f, "interface {m} ")?,
            DstSpec::Edge(n) => write!(f, "edge {n} ")?,
        }
        match &self.src {
            SrcSpec::Any => f.write_str("any"),
            SrcSpec::Interface(None) => f.write_str("interface"),
            SrcSpec::Interface(Some(m)) => write!(f, "interface {m}"),
            SrcSpec::Edge(None) => f.write_str("edge"),
            SrcSpec::Edge(Some(n)) => write!(f, "edge {n}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<RuleSpec, String> {
        RuleSpec::parse(&s.split_whitespace().collect::<Vec<_>>())
    }

    #[test]
    fn parses_every_qualifier() {
        let r = p("02:00:00:00:00:01 not-02:00:00:00:00:02 edge 10.0.0.2 interface 02:00:00:00:00:01").unwrap();
        assert_eq!(r.src_mac, MacQual::Addr("02:00:00:00:00:01".parse().unwrap()));
        assert_eq!(r.dst_mac, MacQual::Not("02:00:00:00:00:02".parse().unwrap()));
        assert_eq!(r.dst, DstSpec::Edge("10.0.0.2".into()));
        assert_eq!(r.src, SrcSpec::Interface(Some("02:00:00:00:00:01".parse().unwrap())));
        let r = p("ANY FF:FF:FF:FF:FF:FF INTERFACE 02:00:00:00:00:01 ANY").unwrap();
        assert_eq!(r.src_mac, MacQual::Any);
        assert_eq!(r.dst_mac, MacQual::Addr(Mac::BROADCAST));
        assert_eq!(r.src, SrcSpec::Any);
        let r = p("02:00:00:00:00:01 none edge peer-b edge").unwrap();
        assert_eq!(r.dst_mac, MacQual::None);
        assert_eq!(r.src, SrcSpec::Edge(None));
    }

    #[test]
    fn prints_what_it_parsed() {
        for s in [
            "02:00:00:00:00:01 not-02:00:00:00:00:02 edge 10.0.0.2 interface 02:00:00:00:00:01",
            "any ff:ff:ff:ff:ff:ff interface 02:00:00:00:00:01 any",
            "02:00:00:00:00:01 none edge peer-b edge",
            "not-02:00:00:00:00:01 any edge fd00::2 edge fd00::3",
        ] {
            assert_eq!(p(s).unwrap().to_string(), s);
        }
    }

    #[test]
    fn canonicalises_ip_link_names() {
        let r = p("any any edge fd00:0::2 any").unwrap();
        assert_eq!(r.dst, DstSpec::Edge("fd00::2".into()));
    }

    #[test]
    fn rejects_bad_rules_with_reasons() {
        let cases = [
            ("any any edge", "too short"),
            ("any any edge 10.0.0.1 any extra more", "at most 6"),
            ("bogus any edge 10.0.0.1 any", "not a MAC qualifier"),
            ("any not-zz edge 10.0.0.1 any", "not a MAC address"),
            ("any any bridge 10.0.0.1 any", "not a destination type"),
            ("any any interface 10.0.0.1 any", "destination interface id"),
            ("any any edge 10.0.0.1 any 10.0.0.2", "takes no id"),
            ("any any edge 10.0.0.1 guest", "not a source type"),
            ("any any edge 10.0.0.1 interface nope", "source interface id"),
            ("none any edge 10.0.0.1 any", "never matches"),
            ("any none edge 10.0.0.1 any", "needs an exact src-MAC"),
            ("not-02:00:00:00:00:01 none edge 10.0.0.1 any", "needs an exact src-MAC"),
            ("any any edge -x any", "not a link name"),
        ];
        for (s, want) in cases {
            let e = p(s).unwrap_err();
            assert!(e.contains(want), "{s}: {e}");
        }
    }
}

//! CNI errors: what a failed command prints on stdout (`{"cniVersion",
//! "code", "msg", "details"}`) before the plugin exits nonzero.

use serde_json::{json, Value};
use std::fmt;

/// The error codes: the spec's well-known ones (0-99) and the plugin's own
/// (100+), as docs/containers.md lists them.
pub mod code {
    /// The config's `cniVersion` is not one the plugin (or its IPAM) speaks,
    /// or the command does not exist in that version.
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    /// A well-known config field the plugin does not implement (`ipMasq`).
    pub const UNSUPPORTED_FIELD: u32 = 2;
    /// The container (its network namespace) does not exist: nothing was
    /// done and nothing needs cleaning up.
    pub const UNKNOWN_CONTAINER: u32 = 3;
    /// A CNI_* environment variable is missing or malformed.
    pub const INVALID_ENV: u32 = 4;
    /// Standard input could not be read.
    pub const IO_FAILURE: u32 = 5;
    /// The config (or its prevResult) is not JSON of the expected shape.
    pub const DECODING_FAILED: u32 = 6;
    /// A config value is invalid (unknown `routes`, an MTU out of range, ...).
    pub const INVALID_CONFIG: u32 = 7;
    /// vnetd does not answer on its socket: retry when it is back.
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// STATUS: vnetd does not answer, so ADD cannot be served.
    pub const NOT_AVAILABLE: u32 = 50;
    /// vnetd refused the request; the message carries its reason.
    pub const VNETD_REFUSED: u32 = 100;
    /// The IPAM plugin could not be found or run, or answered nonsense
    /// (an IPAM plugin's own CNI error is passed on with its own code).
    pub const IPAM_FAILED: u32 = 101;
    /// The container's device could not be configured (addresses, routes).
    pub const CONTAINER_SETUP: u32 = 102;
    /// The state directory could not be read or written.
    pub const STATE: u32 = 103;
    /// CHECK: the attachment is not as ADD left it.
    pub const CHECK_FAILED: u32 = 104;
    /// ADD: the MAC is another guest's (on this host, or in the overlay as
    /// vnet-agent lists it): nothing was done.
    pub const MAC_IN_USE: u32 = 105;
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

/// What every command returns.
pub type CniResult<T> = Result<T, CniError>;

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>) -> CniError {
        CniError { code, msg: msg.into(), details: String::new() }
    }

    pub fn with_details(mut self, details: impl Into<String>) -> CniError {
        self.details = details.into();
        self
    }

    /// The error result, in the version the runtime spoke.
    pub fn to_json(&self, cni_version: &str) -> Value {
        json!({ "cniVersion": cni_version, "code": self.code, "msg": self.msg, "details": self.details })
    }
}

impl fmt::Display for CniError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (CNI error {})", self.msg, self.code)?;
        if !self.details.is_empty() {
            write!(f, ": {}", self.details)?;
        }
        Ok(())
    }
}

/// Shorthand for the many "this config value is invalid" errors.
pub fn invalid_config(msg: impl Into<String>) -> CniError {
    CniError::new(code::INVALID_CONFIG, msg)
}

//! vnet-cni: a CNI plugin (spec versions 0.3.1, 0.4.0, 1.0.0 and 1.1.0)
//! that puts containers on VNET. See docs/containers.md.
//!
//! # Design
//!
//! The plugin holds no network state of its own: vnetd does the work, and
//! the plugin is a short-lived client of its control socket that speaks
//! the control language (docs/control-language.md) like `vnetctl`.
//!
//! - **ADD** sends vnetd one all-or-nothing request: `INTERFACE ADD <name>
//!   <mac> mtu <mtu> netns <ns> veth ifname <CNI_IFNAME> network <net>`,
//!   and with `"routes": "local"` the two rules that deliver frames to the
//!   container (unicast to its MAC, broadcast copies), tagged `owner cni`
//!   so that they go with the interface. vnetd makes a veth pair: the guest
//!   end is CNI_IFNAME in the container's namespace; the host end stays in
//!   vnetd's namespace, where its kernel fast path attaches if loaded, or
//!   where it reads frames through a packet socket if not. So the NIC is a
//!   veth in every case (a TAP brings nothing a veth lacks here). Then the
//!   IPAM plugin is run (ipam.rs), with `routes: local` a rule per IPv6
//!   address for neighbour discovery added, the addresses and routes set on
//!   the device (netns.rs), and the attachment recorded (state.rs). If a
//!   step fails, the earlier ones are taken back.
//! - Names are derived from (CNI_CONTAINERID, CNI_IFNAME) by hashing
//!   (names.rs): vnetd's interface name, the MAC when the runtime gives
//!   none, and the /run/netns name of a namespace given by another path
//!   (which the plugin bind-mounts, since vnetd takes names).
//! - **DEL** removes exactly what the record says ADD made, and what it
//!   can find by the derived names without one, so a second DEL, or a DEL
//!   after a failed ADD, succeeds. With vnetd down it still releases
//!   everything (the device is deleted directly) and succeeds.
//! - **CHECK** compares vnetd, the namespace and the prevResult; **STATUS**
//!   asks vnetd for `SHOW`; **GC** removes records not in
//!   `cni.dev/valid-attachments` as DEL would.
//! - **`vnet-cni restore`** (restore.rs) replays the records into a
//!   restarted vnetd, which takes the existing veth pairs over, so
//!   containers keep their devices, addresses and ifindexes.
//!
//! Errors are CNI error results on stdout (error.rs lists the codes), with
//! vnetd's own reason in the message when it refused; logs go to stderr.

mod cni;
mod config;
mod error;
mod ipam;
mod names;
mod netns;
mod restore;
mod result;
mod state;
mod vnetd;

use clap::{Parser, Subcommand};
use config::{DEFAULT_STATE_DIR, LATEST_VERSION, SUPPORTED_VERSIONS};
use error::{code, CniError};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

const ABOUT: &str = "vnet-cni: a CNI plugin that gives containers a NIC on VNET (a veth that vnetd makes and routes)";

#[derive(Parser, Debug)]
#[command(version, about = ABOUT, after_help = "\
As a CNI plugin it is run by a container runtime, with CNI_COMMAND set and the network config on stdin
(docs/containers.md). By hand:
  vnet-cni restore      # after vnetd restarts: re-add the recorded containers it does not hold")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Re-add to vnetd every recorded attachment it does not hold (run it
    /// after vnetd starts: ExecStartPost=-/usr/lib/cni/vnet-cni restore).
    Restore {
        /// The plugin's state directory (the configs' stateDir).
        #[arg(long, default_value = DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
        /// Only the attachments made through this vnetd control socket
        /// (default: all, each to the socket it was made with).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Seconds to wait for vnetd to answer.
        #[arg(long, default_value_t = 10)]
        wait: u64,
    },
}

fn main() -> ExitCode {
    match std::env::var("CNI_COMMAND") {
        Ok(command) if !command.is_empty() => cni_main(&command),
        _ if std::env::args_os().len() > 1 => {
            let Command::Restore { state_dir, socket, wait } = Cli::parse().command;
            restore::run(&state_dir, socket.as_deref(), Duration::from_secs(wait))
        }
        _ => {
            // As the reference plugins do when run without CNI_COMMAND.
            eprintln!("{ABOUT}\nCNI protocol versions supported: {}", SUPPORTED_VERSIONS.join(", "));
            eprintln!("(run by a container runtime with CNI_COMMAND set; `vnet-cni restore --help` for the subcommand)");
            ExitCode::SUCCESS
        }
    }
}

/// One CNI invocation: the result (if any) or the CNI error on stdout.
fn cni_main(command: &str) -> ExitCode {
    let mut version = LATEST_VERSION.to_string();
    let mut stdin = Vec::new();
    let outcome = match std::io::stdin().read_to_end(&mut stdin) {
        Ok(_) => cni::dispatch(command, &stdin, &mut version),
        Err(e) => Err(CniError::new(code::IO_FAILURE, format!("cannot read the network config from stdin: {e}"))),
    };
    let mut out = std::io::stdout().lock();
    match outcome {
        Ok(result) => {
            if let Some(v) = result {
                let _ = writeln!(out, "{}", serde_json::to_string_pretty(&v).expect("JSON"));
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vnet-cni: {command}: {e}");
            let _ = writeln!(out, "{}", serde_json::to_string_pretty(&e.to_json(&version)).expect("JSON"));
            ExitCode::FAILURE
        }
    }
}

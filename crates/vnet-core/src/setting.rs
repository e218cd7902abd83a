//! The daemon's tunables as the control language names them (`SET`,
//! `INTERFACE SET`): VNET/P's dispatch modes and yield strategies, VNET/P+'s
//! interrupt policy, the datapath choice, and their ranges. Parsing only;
//! what each does is vnetd's (`settings.rs` there, and docs/datapath.md).

/// How a virtual NIC's frames are moved (VNET/P's dispatch modes).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum Mode {
    /// Event-driven: each frame is handled the moment it arrives, sent at once.
    #[default]
    GuestDriven,
    /// Polled: the dispatcher polls the NIC and links, up to a quota of frames
    /// a pass, and sends each pass's frames in batches.
    VmmDriven,
    /// Switches between the two by packet rate, with hysteresis.
    Adaptive,
}

impl Mode {
    pub fn parse(s: &str) -> Result<Mode, String> {
        match s.to_ascii_lowercase().as_str() {
            "guest-driven" | "guest" => Ok(Mode::GuestDriven),
            "vmm-driven" | "vmm" => Ok(Mode::VmmDriven),
            "adaptive" => Ok(Mode::Adaptive),
            _ => Err(format!("'{s}' is not a mode (want guest-driven, vmm-driven or adaptive)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::GuestDriven => "guest-driven",
            Mode::VmmDriven => "vmm-driven",
            Mode::Adaptive => "adaptive",
        }
    }
}

/// What a poll loop does when a pass found no work.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum YieldStrategy {
    /// Give up the CPU and come straight back.
    Immediate,
    /// Sleep T_sleep.
    Timed,
    /// Immediate until idle for T_nowork, then timed.
    #[default]
    Adaptive,
}

impl YieldStrategy {
    pub fn parse(s: &str) -> Result<YieldStrategy, String> {
        match s.to_ascii_lowercase().as_str() {
            "immediate" => Ok(YieldStrategy::Immediate),
            "timed" => Ok(YieldStrategy::Timed),
            "adaptive" => Ok(YieldStrategy::Adaptive),
            _ => Err(format!("'{s}' is not a yield strategy (want immediate, timed or adaptive)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            YieldStrategy::Immediate => "immediate",
            YieldStrategy::Timed => "timed",
            YieldStrategy::Adaptive => "adaptive",
        }
    }
}

/// How a virtio NIC interrupts its guest for received frames
/// (`SET interrupts`; VNET/P+, docs/vhost-user.md).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum Interrupts {
    /// Once the frames are in the guest's buffers, if it asked (virtio's
    /// event index), once per dispatcher pass: the default, because
    /// optimistic interrupts measured no better here (docs/vhost-user.md).
    #[default]
    Plain,
    /// VNET/P+: an early virtual interrupt before the frames are copied in,
    /// and an end-of-coalescing decision by receive density (α, β).
    Optimistic,
}

impl Interrupts {
    pub fn parse(s: &str) -> Result<Interrupts, String> {
        match s.to_ascii_lowercase().as_str() {
            "plain" => Ok(Interrupts::Plain),
            "optimistic" => Ok(Interrupts::Optimistic),
            _ => Err(format!("'{s}' is not an interrupt policy (want plain or optimistic)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Interrupts::Plain => "plain",
            Interrupts::Optimistic => "optimistic",
        }
    }
}

/// Which datapath carries frames (`SET datapath`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum Datapath {
    /// The kernel fast path where it loaded, else the user-level one.
    #[default]
    Auto,
    /// The kernel fast path (refused where it did not load).
    Kernel,
    /// vnetd's user-level datapath only.
    User,
}

impl Datapath {
    pub fn parse(s: &str) -> Result<Datapath, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Datapath::Auto),
            "kernel" => Ok(Datapath::Kernel),
            "user" => Ok(Datapath::User),
            _ => Err(format!("'{s}' is not a datapath (want auto, kernel or user)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Datapath::Auto => "auto",
            Datapath::Kernel => "kernel",
            Datapath::User => "user",
        }
    }
}

/// What `INTERFACE SET` sets: `None` means "follow the global value".
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum IfaceSetting {
    Mode(Option<Mode>),
    AlphaLower(Option<u32>),
    AlphaUpper(Option<u32>),
    WindowMs(Option<u32>),
}

impl IfaceSetting {
    pub fn parse(key: &str, value: &str) -> Result<IfaceSetting, String> {
        let default = value.eq_ignore_ascii_case("default");
        let per_iface = "an interface takes mode, alpha-lower, alpha-upper or window-ms \
                         (yield, sleep-us, nowork-us and quota belong to the dispatcher threads: use SET)";
        let num = |s: Setting| -> Option<u32> {
            match s {
                Setting::AlphaLower(v) | Setting::AlphaUpper(v) | Setting::WindowMs(v) => Some(v),
                _ => None,
            }
        };
        let parsed = |k: &str| -> Result<Option<u32>, String> {
            if default {
                Ok(None)
            } else {
                Ok(num(Setting::parse(k, value)?))
            }
        };
        Ok(match key.to_ascii_lowercase().as_str() {
            "mode" => IfaceSetting::Mode(if default { None } else { Some(Mode::parse(value)?) }),
            "alpha-lower" => IfaceSetting::AlphaLower(parsed("alpha-lower")?),
            "alpha-upper" => IfaceSetting::AlphaUpper(parsed("alpha-upper")?),
            "window-ms" => IfaceSetting::WindowMs(parsed("window-ms")?),
            other => return Err(format!("'{other}' is not an interface setting: {per_iface}")),
        })
    }
}

/// One `SET key value`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Setting {
    Mode(Mode),
    Yield(YieldStrategy),
    /// T_sleep, µs.
    SleepUs(u32),
    /// T_nowork, µs.
    NoworkUs(u32),
    /// α_l, packets/s.
    AlphaLower(u32),
    /// α_u, packets/s.
    AlphaUpper(u32),
    /// ω, ms.
    WindowMs(u32),
    /// Frames taken from one source per pass.
    Quota(u32),
    /// Which datapath carries frames.
    Datapath(Datapath),
    /// How virtio NICs interrupt their guests.
    Interrupts(Interrupts),
    /// Optimistic interrupts' receive-density thresholds α and β, kB/s.
    EocAlpha(u32),
    EocBeta(u32),
    /// Cut-through: frames sent from a guest's shared memory without a copy.
    CutThrough(bool),
    /// Storm control: broadcast and multicast frames each guest may send a
    /// second (a burst of as many); 0: no limit.
    StormPps(u32),
}

impl Setting {
    pub fn parse(key: &str, value: &str) -> Result<Setting, String> {
        let num = |lo: u32, hi: u32| -> Result<u32, String> {
            let v: u32 = value.parse().map_err(|_| format!("'{value}' is not a number"))?;
            if !(lo..=hi).contains(&v) {
                return Err(format!("{key} {v} is out of range {lo}..{hi}"));
            }
            Ok(v)
        };
        Ok(match key.to_ascii_lowercase().as_str() {
            "mode" => Setting::Mode(Mode::parse(value)?),
            "yield" => Setting::Yield(YieldStrategy::parse(value)?),
            "sleep-us" => Setting::SleepUs(num(1, 1_000_000)?),
            "nowork-us" => Setting::NoworkUs(num(0, 10_000_000)?),
            "alpha-lower" => Setting::AlphaLower(num(1, 100_000_000)?),
            "alpha-upper" => Setting::AlphaUpper(num(1, 100_000_000)?),
            "window-ms" => Setting::WindowMs(num(1, 10_000)?),
            "quota" => Setting::Quota(num(1, 4096)?),
            "datapath" => Setting::Datapath(Datapath::parse(value)?),
            "interrupts" => Setting::Interrupts(Interrupts::parse(value)?),
            "eoc-alpha" => Setting::EocAlpha(num(0, 100_000_000)?),
            "eoc-beta" => Setting::EocBeta(num(1, 100_000_000)?),
            "cut-through" => Setting::CutThrough(match value.to_ascii_lowercase().as_str() {
                "on" => true,
                "off" => false,
                _ => return Err(format!("'{value}' is not on or off")),
            }),
            "storm-pps" => Setting::StormPps(num(0, 10_000_000)?),
            _ => {
                return Err(format!(
                    "'{key}' is not a setting (want mode, yield, sleep-us, nowork-us, alpha-lower, alpha-upper, window-ms, quota, datapath, interrupts, eoc-alpha, eoc-beta, cut-through or storm-pps)"
                ))
            }
        })
    }
}

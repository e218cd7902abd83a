//! Sets of counters whose names are written once, shared by every crate
//! that shows counters in `STATS` (vnetd's datapath, the vhost-user rings).
//! The macro is exported at the crate's root: `vnet_core::counter_set!`.

/// Declares a set of counters whose names are written once: each field is
/// an `AtomicU64` (relaxed: readers want totals, not ordering), and
/// `fields()` gives every counter as (name, value) in declaration order for
/// `STATS` (and so for `/metrics`). A field shown under another name than
/// its own says so: `connects as "vhost_connects"`.
///
/// ```ignore
/// counter_set! {
///     /// What software offload work the datapath did.
///     pub struct OffloadCounters {
///         /// Super-frames cut into segments.
///         segmented,
///     }
/// }
/// ```
#[macro_export]
macro_rules! counter_set {
    (@name $field:ident) => { stringify!($field) };
    (@name $field:ident $shown:literal) => { $shown };
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $( $(#[$fmeta:meta])* $field:ident $(as $shown:literal)? ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Default, Debug)]
        $vis struct $name {
            $( $(#[$fmeta])* pub $field: ::std::sync::atomic::AtomicU64, )*
        }

        impl $name {
            /// How many counters the set has.
            pub const LEN: usize = [$(stringify!($field)),*].len();

            /// Every counter as (name, value), in declaration order.
            pub fn fields(&self) -> [(&'static str, u64); Self::LEN] {
                [$( ($crate::counter_set!(@name $field $($shown)?), self.$field.load(::std::sync::atomic::Ordering::Relaxed)) ),*]
            }

            /// ` name=value` for every counter, appended to `out`.
            pub fn render_into(&self, out: &mut String) {
                use ::std::fmt::Write;
                for (n, v) in self.fields() {
                    let _ = write!(out, " {n}={v}");
                }
            }
        }
    };
}

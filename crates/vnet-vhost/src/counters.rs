//! What one vhost-user NIC did, for `STATS` (names written once).

vnet_core::counter_set! {
    /// What a vhost-user NIC did, for `STATS`.
    pub struct Counters {
        connects as "vhost_connects",
        /// Chains the guest queued that could not be read (returned unread).
        bad_chains as "vhost_bad_chains",
        /// Receive chains with no writable byte, returned used with length 0.
        empty_rx_chains as "vhost_empty_rx_chains",
        /// Chains longer than the queue (indirect tables included): the ring
        /// that had one is broken.
        long_chains as "vhost_long_chains",
        /// Rings marked broken (a chain longer than the queue, too many bad
        /// chains in a row, a fault on guest memory): left alone until the
        /// frontend resets or reconnects.
        broken_rings as "vhost_broken_rings",
        /// Passes that stopped at the descriptor budget (the rest waits for
        /// the next pass, after the other NICs had theirs).
        budget_stops as "vhost_budget_stops",
        /// Call or kick descriptors refused: not an eventfd.
        refused_fds as "vhost_refused_fds",
        /// Memory tables refused: a file that can shrink (no F_SEAL_SHRINK)
        /// without `unsealed-memory`, or a region past its file's end.
        refused_memory as "vhost_refused_memory",
        /// Dirty-page logs set up (`SET_LOG_BASE`, a migration beginning or
        /// its log resized), and logs refused (too big, past their file's
        /// end, not sealed against shrinking).
        dirty_logs as "vhost_dirty_logs",
        refused_logs as "vhost_refused_logs",
        /// Faults on guest memory survived (its file shrank): the device is
        /// broken until the frontend sets up new memory.
        memory_faults as "vhost_memory_faults",
        /// Interrupts sent to the guest, for frames received and for frames
        /// sent (transmit buffers returned).
        rx_interrupts as "vhost_rx_interrupts",
        tx_interrupts as "vhost_tx_interrupts",
        /// Interrupts sent as a ring started, and as a running ring took a
        /// new call descriptor: one each, whatever the guest's event index
        /// says. An interrupt lost (a vnetd killed between publishing used
        /// entries and interrupting for them; one written to a descriptor
        /// the frontend then replaced and cleared) leaves the guest's event
        /// index behind the used index, where no later entry crosses it:
        /// the guest never hears of a frame again (seen under load in CI: a
        /// VM deaf after vnetd's restart). Spurious ones are harmless (the
        /// driver finds nothing new).
        start_interrupts as "vhost_start_interrupts",
        /// Interrupts not sent because the guest's call eventfd was full
        /// (an interrupt was pending anyway).
        interrupts_pending as "vhost_interrupts_pending",
        /// Frames written into the guest's receive buffers, or held for them
        /// (`rx_held_*`).
        rx_frames as "vhost_rx_frames",
        /// Frames that arrived while the receive ring was not running, held
        /// for it (`held`), and of those: written once it started, and
        /// expired or not writable then (dropped).
        rx_held_frames as "vhost_rx_held_frames",
        rx_held_delivered as "vhost_rx_held_delivered",
        rx_held_expired as "vhost_rx_held_expired",
        /// Frames a vnetd that was killed had taken from the guest (sent, or
        /// being sent) that the vnetd after it handed back unsent instead of
        /// sending again (`taken`): at most once across a crash.
        tx_handed_back_at_takeover as "vhost_tx_handed_back_at_takeover",
        /// Times a long burst was made visible to the guest before its end
        /// (every `PUBLISH_EVERY` frames).
        rx_mid_burst as "vhost_rx_mid_burst_publishes",
        /// Interrupts sent at such a point because the guest asked for one
        /// there (its event index fell inside the stretch).
        rx_mid_burst_interrupts as "vhost_rx_mid_burst_interrupts",
        /// Optimistic interrupts: early virtual interrupts sent, and found the
        /// guest's interrupts off; end-of-coalescing decisions by reason.
        evi_sent,
        evi_suppressed,
        eoc_not_needed,
        eoc_masked,
        eoc_cold,
        eoc_density,
        eoc_hot,
        /// An EoC interrupt not sent because the last one was still unread.
        eoc_pending,
        idle_interrupts,
        /// Cut-through: frames from the guest sent from where they lay (bytes:
        /// those not copied); every one had its headers copied first
        /// (`tx_head_copied_bytes`), which is what vnetd routed on.
        tx_in_place_frames,
        tx_in_place_bytes,
        tx_gathered_frames,
        tx_head_copied_bytes,
        /// Copied although cut-through was on: frames no longer than
        /// `MAX_HEAD` (an iovec would cost more), and frames that could not be
        /// gathered (more than `MAX_PIECES` buffers, a buffer across memory
        /// regions).
        tx_copied_small_frames,
        tx_copied_small_bytes,
        tx_copied_scattered_frames,
        tx_copied_scattered_bytes,
    }
}

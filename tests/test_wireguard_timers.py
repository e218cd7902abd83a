"""WireGuard's timers over 200 s (W15): handshake retries every 5 s for
90 s, then the frames that waited dropped and counted, and the next frame
starting again; a rekey after 2 minutes; a session's data refused as a
replay while it lives and as no session's once it expired (3 minutes).

The lab runs beside the other tests from the start of the session
(`wg_timers.py`, started by conftest.py), so its 200 s cost the test
command nothing; run alone, this test waits for it."""

import wg_timers


def last(readings, what, before=None):
    xs = [(t, s) for t, w, s in readings if w == what and (before is None or t <= before)]
    return xs[-1] if xs else (None, {})


def test_handshake_retries_give_up_rekeys_and_session_expiry_follow_wireguards_timers():
    sc = wg_timers.start()
    sc.join(timeout=wg_timers.RUN_S + 120)
    assert not sc.is_alive(), "the timers' lab did not finish"
    assert sc.error is None, sc.error
    assert not sc.problems, sc.problems
    r = sc.readings
    # Host 1 -> host 9 (nobody answers): retries every 5 s...
    t30, s30 = last(r, "h1.h9", before=31)
    assert 5 <= s30["wg_initiations"] <= 8, (t30, s30)
    # ... until 90 s, when the handshake and its 5 frames are given up,
    # each frame counted `unreachable` on the link and daemon-wide.
    t95, s95 = last(r, "h1.h9", before=99)
    assert 16 <= s95["wg_initiations"] <= 21 and s95["wg_handshakes_given_up"] == 1, (t95, s95)
    assert s95["drop_unreachable"] == 5 and s95["out_frames"] == 0, s95
    assert last(r, "h1.global", before=99)[1]["drop_unreachable"] == 5
    # Nothing more until the next frame (sent at 100 s), which starts over.
    assert s95["wg_initiations"] == last(r, "h1.h9", before=sc.notes["more_sent_at"])[1]["wg_initiations"]
    t_end, s_end = last(r, "h1.h9")
    assert s_end["wg_initiations"] > s95["wg_initiations"], (s95, s_end)
    # Hosts 2 and 3, a ping a second: a rekey after 2 minutes, not before.
    rekeys = lambda t: sum(last(r, w, before=t)[1].get("wg_rekeys", 0) for w in ("h2.h3", "h3.h2"))  # noqa: E731
    assert rekeys(110) == 0, [x for x in r if x[1] in ("h2.h3", "h3.h2") and x[0] < 115]
    assert rekeys(1e9) >= 1, last(r, "h2.h3")
    # A recorded data message of the first session: a replay at 60 s, no
    # session's at 190 s (sessions expire 3 minutes after they are made).
    assert sc.notes["captured"] >= 1
    before_early = last(r, "h3.h2", before=sc.notes["early_replay_at"] - 0.1)[1]
    after_early = last(r, "h3.h2", before=sc.notes["early_replay_at"] + 5.5)[1]
    assert after_early["wg_replays"] == before_early["wg_replays"] + 1, (before_early, after_early)
    before_late = last(r, "h3.h2", before=sc.notes["late_replay_at"] - 0.1)[1]
    after_late = last(r, "h3.h2")[1]
    assert after_late["wg_no_session"] == before_late["wg_no_session"] + 1, (before_late, after_late)
    assert after_late["wg_replays"] == before_late["wg_replays"], (before_late, after_late)
    # The ping went through all along (a rekey loses nothing).
    assert " 0% packet loss" in sc.notes["ping"], sc.notes["ping"]

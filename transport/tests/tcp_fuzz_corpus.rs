//! Runs the `tcp_records` fuzz target's scripted hostile peer (`fuzz/tcp_script.rs`) as an
//! ordinary test: the committed seeds (`fuzz/seeds/tcp_records/`), then a few hundred
//! scripts from a fixed pseudo-random sequence, so a change to the tcp link meets a hostile
//! peer on stable too. The fuzzer itself never runs here; `fuzz/README.md` says how to run
//! it. Regenerate the seeds with
//! `cargo test -p ibex-transport --test tcp_fuzz_corpus -- --ignored write_seeds`.

use std::path::{Path, PathBuf};

#[path = "../fuzz/tcp_script.rs"]
mod tcp_script;

use tcp_script::Outcome;
use tcp_script::step::*;

fn seed_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/tcp_records")
}

fn explicit(step: u8, region: u64, then: u8) -> Vec<u8> {
    let mut v = vec![step, EXPLICIT];
    v.extend(region.to_le_bytes());
    v.push(then);
    v
}

type Check = fn(&Outcome) -> bool;

fn failed_with(o: &Outcome, text: &str) -> bool {
    o.error.as_deref().is_some_and(|e| e.contains(text))
}

/// Hand-shaped scripts, one per path through the link's push and read handling, each with
/// what it must have done.
fn seeds() -> Vec<(&'static str, Vec<u8>, Check)> {
    let mut dropped = Vec::new();
    // Three 2 MiB pushes (regions 7, 15 and 23) before any read: two are held, one dropped.
    for r in [7, 15, 23] {
        dropped.extend(explicit(PUSH, r, 1));
    }
    dropped.push(PUMP);
    for r in [7, 15, 23] {
        dropped.extend(explicit(POST_REGION, r, 0x03));
    }
    dropped.push(PUMP);
    for _ in 0..4 {
        dropped.extend([ANSWER, 2, PUMP]);
    }
    vec![
        // Reads posted first, in two fragments, then the push fills them directly.
        (
            "direct",
            vec![POST_REGION, 0, 0x01, PUSH, 0, 1, PUMP],
            |o| o.pushes.direct == 1 && o.reads_ok == 2,
        ),
        // The push first (held), then reads of it in four fragments.
        (
            "held",
            {
                let mut v = vec![PUSH, 0, 1, PUMP];
                v.extend(explicit(POST_REGION, 1, 0x03));
                v.push(PUMP);
                v
            },
            |o| o.pushes.held == 1 && o.reads_ok == 4,
        ),
        // Regions 1 and 2 held, then a read of region 4: their reads will not come, so the
        // link lets them go, and drops region 3 when it comes; region 4 goes straight in.
        (
            "let-go",
            {
                let mut v = vec![PUSH, 0, 1, PUSH, 0, 1, PUMP];
                v.extend(explicit(POST_REGION, 4, 0x00));
                v.extend([PUSH, 0, 1, PUSH, 0, 1, PUMP]);
                v
            },
            |o| {
                let p = o.pushes;
                p.held == 2
                    && p.dropped == 1
                    && p.direct == 1
                    && o.reads_ok == 1
                    && o.held_at_end == 0
            },
        ),
        ("dropped", dropped, |o| {
            o.pushes.held == 2 && o.pushes.dropped == 1 && o.pushes.asked == 4 && o.reads_ok == 12
        }),
        // An unmarked read asks; the peer answers, then refuses the next.
        (
            "asked",
            vec![
                POST_REGION,
                0,
                0x80,
                PUMP,
                ANSWER,
                2,
                POST_REGION,
                1,
                0x80,
                PUMP,
                ANSWER,
                0,
                PUMP,
            ],
            |o| o.reads_ok == 1 && o.reads_failed == 1 && o.peer_got[0] == 2,
        ),
        // A marked region never pushed: a later push makes its reads ask.
        (
            "skipped",
            vec![POST_REGION, 0, 0x00, PUSH, 1, 1, PUMP, ANSWER, 2, PUMP],
            |o| o.pushes.asked == 1 && o.reads_ok == 1,
        ),
        // The owner's bodies, pushed to the peer and read back by it whole and in part.
        // Two bodies pushed behind the owner's frame, one exposed for reads only; the peer
        // reads two of them back.
        (
            "exposed",
            vec![
                EXPOSE,
                3,
                EXPOSE,
                0x87,
                EXPOSE,
                5,
                OWNER_FRAME,
                10,
                0,
                PEER_ASK,
                0,
                PEER_ASK,
                2,
                PUMP,
            ],
            |o| o.pushes.sent == 2 && o.peer_got == [0, 2, 2],
        ),
        // A descriptor of the wrong length, then a read past its region's end.
        (
            "bad-descriptor",
            {
                let mut v = vec![POST_RAW, 0, 7, 1, 2, 3, 4, 5, 6, 7, 0, 0, 1, 0];
                v.extend([POST_RAW, 1]);
                v.extend(3u64.to_le_bytes());
                v.extend(100u64.to_le_bytes());
                v.extend([7, 0, 1, 0, PUMP]);
                v
            },
            |o| o.posts_refused == 2 && o.error.is_none(),
        ),
        ("frames", vec![FRAME, 10, 0, FRAME, 0x88, 0x13, PUMP], |o| {
            o.frames == 2
        }),
        (
            "bad-push-length",
            vec![POST_REGION, 0, 0x00, PUSH, 0, 0xc1, PUMP],
            |o| failed_with(o, "claims 101 bytes") && o.reads_failed == 1,
        ),
        (
            "bad-push-order",
            vec![PUSH, 1, 1, PUSH, 200, 1, PUMP],
            |o| failed_with(o, "exposure order"),
        ),
        (
            "bad-answer",
            vec![POST_REGION, 0, 0x80, PUMP, ANSWER, 0x81, PUMP],
            |o| failed_with(o, "keep request order"),
        ),
        (
            "garbage",
            vec![POST_REGION, 0, 0x00, GARBAGE, 5, 9, 0, 0, 0, 0, PUMP],
            |o| failed_with(o, "unknown tcp record type 9") && o.reads_failed == 1,
        ),
    ]
}

#[test]
fn seeds_take_their_paths() {
    for (name, script, check) in seeds() {
        let path = seed_dir().join(format!("{name}.bin"));
        let committed = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(
            committed, script,
            "{name}: the committed seed is stale; regenerate it"
        );
        let out = tcp_script::run(&script);
        assert!(check(&out), "{name} did not take its path: {out:?}");
    }
}

#[test]
fn every_committed_seed_runs_clean() {
    let dir = seed_dir();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        tcp_script::run(&std::fs::read(&path).unwrap());
    }
}

/// Scripts made of whole steps, mostly the ones an honest exchange is made of, so that
/// they get past the first few steps; rarely a hostile one.
fn script(next: &mut impl FnMut() -> u64) -> Vec<u8> {
    let mut v = Vec::new();
    for _ in 0..1 + next() % 24 {
        let r = next();
        let b = |i: u32| (r >> (8 * i)) as u8;
        match r % 20 {
            0..=3 => v.extend([POST_REGION, b(1) % 3, b(2) & 0x43]),
            4..=6 => v.extend([PUSH, b(1) % 3, 1]),
            7..=9 => v.push(PUMP),
            10 | 11 => v.extend([ANSWER, 2 + b(1) % 6]),
            12 => v.extend([EXPOSE, b(1)]),
            13 => v.extend([OWNER_FRAME, b(1), b(2) % 16]),
            14 => v.extend([PEER_ASK, b(1) & 0xfe]),
            15 => v.extend([FRAME, b(1), b(2) % 16]),
            16 => v.extend(explicit(PUSH, u64::from(b(1) % 32), 1)),
            17 => v.extend(explicit(POST_REGION, u64::from(b(1) % 32), b(2) & 0x43)),
            // Anything at all: a hostile step, or bytes the next steps read.
            _ => v.extend((0..1 + u32::from(b(1)) % 16).map(|i| b(2 + i % 6))),
        }
    }
    v
}

#[test]
fn seeded_scripts_run_clean() {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut seen = Outcome::default();
    for _ in 0..300 {
        let script = script(&mut next);
        let o = match std::panic::catch_unwind(|| tcp_script::run(&script)) {
            Ok(o) => o,
            Err(_) => panic!("script failed: {script:?}"),
        };
        seen.pushes.accumulate(&o.pushes);
        seen.reads_ok += o.reads_ok;
        seen.reads_failed += o.reads_failed;
        seen.peer_got[1] += o.peer_got[1];
    }
    // The scripts reach every way a push can go, and both ways a read can end.
    let p = seen.pushes;
    assert!(
        p.direct > 0 && p.held > 0 && p.dropped > 0 && p.asked > 0 && p.sent > 0,
        "{seen:?}"
    );
    assert!(
        seen.reads_ok > 0 && seen.reads_failed > 0 && seen.peer_got[1] > 0,
        "{seen:?}"
    );
}

#[test]
#[ignore = "writes fuzz/seeds/tcp_records; run by hand after a format change"]
fn write_seeds() {
    let dir = seed_dir();
    std::fs::create_dir_all(&dir).unwrap();
    for (name, script, _) in seeds() {
        std::fs::write(dir.join(format!("{name}.bin")), script).unwrap();
    }
}

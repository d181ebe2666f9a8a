//! Runs the committed fuzz seeds (`fuzz/seeds/<target>/`) through the decoders as an
//! ordinary test: `ok-*.bin` must decode and re-encode to the same bytes, `bad-*.bin` must
//! be rejected with the error its name promises. The fuzzer itself never runs here.
//! Targets: `frame_decode` (the frame format), `preface_decode` (the set-up preface of
//! every provider, and shm's bytes in it), `verbs_bootstrap` (the verbs queue pair info).

use std::path::{Path, PathBuf};

use bytes::Bytes;
use ibex_transport::preface::{self, Preface, Provider};
use ibex_transport::proto::frame::{Body, Frame, FrameError, kind};
use ibex_transport::verbs_wire::{QpInfo, body_len, frame};

fn target_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target)
}

/// The committed seeds of `target`, sorted, as (name without `.bin`, bytes).
fn on_disk(target: &str) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(target_dir(target))
        .unwrap_or_else(|e| panic!("seed directory fuzz/seeds/{target}: {e}"))
        .map(|e| e.expect("dir entry").path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let name = path
                .file_stem()
                .and_then(|s| s.to_str())
                .expect("utf-8 file name")
                .to_owned();
            (name, std::fs::read(&path).expect("read seed"))
        })
        .collect()
}

/// Every generated seed is on disk, byte for byte.
fn assert_generated(target: &str, seeds: Vec<(&'static str, Vec<u8>)>) {
    for (name, bytes) in seeds {
        let on_disk =
            std::fs::read(target_dir(target).join(format!("{name}.bin"))).unwrap_or_else(|e| {
                panic!("seed {target}/{name}.bin missing ({e}); run the ignored write_seeds test")
            });
        assert_eq!(
            on_disk, bytes,
            "{target}/{name}.bin is stale; run the ignored write_seeds test"
        );
    }
}

fn write(target: &str, seeds: Vec<(&'static str, Vec<u8>)>) {
    std::fs::create_dir_all(target_dir(target)).expect("create seed dir");
    for (name, bytes) in seeds {
        std::fs::write(target_dir(target).join(format!("{name}.bin")), bytes).expect("write seed");
    }
}

/// The seeds: valid frames of every kind, and one frame per decode error.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let desc = Bytes::from_static(b"\x01\x00\x00\x00\x00\x00\x00\x00shm:seg0");
    let ok = |f: Frame| f.to_bytes().to_vec();
    let raw = |kind: u8, flags: u8, body: &[u8]| {
        let mut v = vec![0x49, 1, kind, flags, 0, 0, 0, 0];
        v.extend_from_slice(&(body.len() as u32).to_le_bytes());
        v.extend_from_slice(body);
        v
    };
    let mut oversize_desc = vec![0u8; 16];
    oversize_desc.extend_from_slice(&300u16.to_le_bytes());
    oversize_desc.resize(16 + 2 + 300, 0);
    let mut oversize_ext = vec![0u8; 20];
    oversize_ext.extend_from_slice(&2048u16.to_le_bytes());
    vec![
        (
            "ok-hello",
            ok(Frame::new(Body::Hello {
                slots: 64,
                slot_size: 65536,
                max_message: 1 << 30,
                fragment_size: 512 << 10,
                ext: Bytes::new(),
            })),
        ),
        (
            "ok-eager-one",
            ok(Frame {
                credits: 3,
                body: Body::Eager {
                    msgs: vec![Bytes::from_static(b"hello, parameter server")],
                },
            }),
        ),
        (
            "ok-eager-coalesced",
            ok(Frame::new(Body::Eager {
                msgs: vec![
                    Bytes::from_static(b"a"),
                    Bytes::new(),
                    Bytes::from(vec![7u8; 300]),
                ],
            })),
        ),
        (
            "ok-rts",
            ok(Frame::new(Body::Rts {
                seq: 12,
                len: 256 << 20,
                desc: desc.clone(),
                head: Bytes::new(),
            })),
        ),
        (
            "ok-rts-with-head",
            ok(Frame::new(Body::Rts {
                seq: 13,
                len: 1 << 20,
                desc: desc.clone(),
                head: Bytes::from_static(b"a packet"),
            })),
        ),
        (
            "ok-rndv-done",
            ok(Frame {
                credits: 1,
                body: Body::RndvDone {
                    seq: 12,
                    probe: false,
                },
            }),
        ),
        (
            "ok-rndv-done-probe",
            ok(Frame::new(Body::RndvDone {
                seq: 5,
                probe: true,
            })),
        ),
        (
            "ok-credit",
            ok(Frame {
                credits: 32,
                body: Body::Credit,
            }),
        ),
        (
            "ok-probe-eager",
            ok(Frame::new(Body::ProbeEager {
                probe_id: 0,
                pad: Bytes::from(vec![0u8; 1024]),
            })),
        ),
        (
            "ok-probe-ack",
            ok(Frame::new(Body::ProbeAck { probe_id: 0 })),
        ),
        (
            "ok-probe-rts",
            ok(Frame::new(Body::ProbeRts {
                probe_id: 4,
                len: 4096,
                desc,
            })),
        ),
        (
            "ok-close",
            ok(Frame::new(Body::Close {
                code: 0,
                reason: "bye".into(),
            })),
        ),
        ("bad-short-header", vec![0x49, 1, 5, 0]),
        ("bad-magic", {
            let mut v = raw(kind::CREDIT, 0, &[]);
            v[0] = 0x47;
            v
        }),
        ("bad-version", {
            let mut v = raw(kind::CREDIT, 0, &[]);
            v[1] = 2;
            v
        }),
        ("bad-kind", raw(0, 0, &[])),
        ("bad-flags", raw(kind::CREDIT, 0x02, &[])),
        ("bad-body-len", {
            let mut v = raw(kind::PROBE_ACK, 0, &[1, 0, 0, 0]);
            v[8] = 9;
            v
        }),
        (
            "bad-truncated",
            raw(kind::RTS, 0, &[1, 0, 0, 0, 0, 0, 0, 0, 5]),
        ),
        ("bad-zero-count", raw(kind::EAGER, 0, &[0, 0])),
        (
            "bad-length-past-end",
            raw(
                kind::EAGER,
                0,
                &[2, 0, 1, 0, 0, 0, b'x', 200, 0, 0, 0, b'y'],
            ),
        ),
        ("bad-trailing", raw(kind::RNDV_DONE, 0, &[0; 9])),
        ("bad-desc-too-long", raw(kind::RTS, 0, &oversize_desc)),
        ("bad-ext-too-long", raw(kind::HELLO, 0, &oversize_ext)),
        (
            // The head flag with nothing after the descriptor: a second encoding of a
            // plain RTS (found by the fuzzer).
            "bad-empty-head",
            raw(
                kind::RTS,
                0x01,
                &[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            ),
        ),
    ]
}

/// The error a `bad-*` seed must produce.
fn expected_error(name: &str, e: &FrameError) -> bool {
    match name {
        "bad-short-header" => matches!(e, FrameError::ShortHeader { .. }),
        "bad-magic" => matches!(e, FrameError::BadMagic(_)),
        "bad-version" => matches!(e, FrameError::UnsupportedVersion(_)),
        "bad-kind" => matches!(e, FrameError::UnknownKind(_)),
        "bad-flags" => matches!(e, FrameError::UnknownFlags { .. }),
        "bad-body-len" => matches!(e, FrameError::BodyLenMismatch { .. }),
        "bad-truncated" => matches!(e, FrameError::Truncated { .. }),
        "bad-zero-count" => matches!(e, FrameError::ZeroCount),
        "bad-length-past-end" => matches!(e, FrameError::LengthPastEnd { .. }),
        "bad-trailing" => matches!(e, FrameError::TrailingBytes { .. }),
        "bad-desc-too-long" => matches!(e, FrameError::DescTooLong(_)),
        "bad-ext-too-long" => matches!(e, FrameError::ExtTooLong(_)),
        "bad-empty-head" => matches!(e, FrameError::Truncated { field: "head", .. }),
        // Seeds added by hand (e.g. minimised fuzz findings) need only be rejected.
        _ => true,
    }
}

#[test]
fn committed_seeds_decode_as_their_names_say() {
    let (mut good, mut bad) = (0, 0);
    let mut kinds = std::collections::BTreeSet::new();
    for (name, bytes) in on_disk("frame_decode") {
        let bytes = Bytes::from(bytes);
        let result = Frame::decode(&bytes);
        if name.starts_with("ok-") {
            let frame = result.unwrap_or_else(|e| panic!("{name} should decode: {e}"));
            assert_eq!(
                frame.to_bytes(),
                bytes,
                "{name} does not re-encode to itself"
            );
            kinds.insert(frame.body.kind());
            good += 1;
        } else if name.starts_with("bad-") {
            match result {
                Err(e) => assert!(
                    expected_error(&name, &e),
                    "{name} failed with the wrong error: {e}"
                ),
                Ok(f) => panic!("{name} should be rejected but decoded as {f:?}"),
            }
            bad += 1;
        } else {
            panic!("seed {name} must be named ok-* or bad-*");
        }
    }
    assert_eq!(kinds.len(), 9, "valid seeds must cover every frame kind");
    assert!(
        bad >= 12,
        "one malformed seed per decode error ({bad} found)"
    );
    assert!(good >= 9);
}

#[test]
fn committed_seeds_match_the_generator() {
    assert_generated("frame_decode", seeds());
    assert_generated("preface_decode", preface_seeds());
    assert_generated("verbs_bootstrap", bootstrap_seeds());
}

#[test]
#[ignore = "writes fuzz/seeds/*; run by hand after a wire-format change"]
fn write_seeds() {
    write("frame_decode", seeds());
    write("preface_decode", preface_seeds());
    write("verbs_bootstrap", bootstrap_seeds());
}

// ---- preface_decode ----------------------------------------------------------------------

/// shm's 52 bytes: pid, credits, ring, pool, bounce slot and count, probe word and value.
fn shm_ext(credits: u32, ring: u64) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&42u32.to_le_bytes());
    v.extend_from_slice(&credits.to_le_bytes());
    v.extend_from_slice(&ring.to_le_bytes());
    v.extend_from_slice(&(256u64 << 20).to_le_bytes());
    v.extend_from_slice(&(256u64 << 10).to_le_bytes());
    v.extend_from_slice(&8u32.to_le_bytes());
    v.extend_from_slice(&0x1000u64.to_le_bytes());
    v.extend_from_slice(&7u64.to_le_bytes());
    v
}

fn preface_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let p = |token: &[u8], ext: Vec<u8>| Preface {
        slot_size: 65536,
        features: 0,
        token: token.to_vec(),
        ext,
    };
    let tcp = p(b"", vec![]).encode(Provider::Tcp);
    let patched = |at: usize, with: &[u8]| {
        let mut v = tcp.clone();
        v[at..at + with.len()].copy_from_slice(with);
        v
    };
    let with_token = p(b"secret", vec![]).encode(Provider::Tcp);
    vec![
        ("ok-tcp", tcp.clone()),
        ("ok-tcp-token", with_token.clone()),
        ("ok-verbs", p(b"", vec![]).encode(Provider::Verbs)),
        (
            "ok-shm",
            p(b"job-7", shm_ext(64, 4 << 20)).encode(Provider::Shm),
        ),
        (
            "ok-tcp-features",
            Preface {
                features: u32::MAX,
                ..p(b"", vec![])
            }
            .encode(Provider::Tcp),
        ),
        (
            "badshm-short-ext",
            p(b"", shm_ext(64, 4 << 20)[..51].to_vec()).encode(Provider::Shm),
        ),
        (
            "badshm-no-credits",
            p(b"", shm_ext(0, 4 << 20)).encode(Provider::Shm),
        ),
        (
            "badshm-tiny-ring",
            p(b"", shm_ext(64, 64)).encode(Provider::Shm),
        ),
        (
            "bad-magic",
            b"GET / HTTP/1.1\r\nHost: ibex\r\n\r\n".to_vec(),
        ),
        ("bad-short", tcp[..10].to_vec()),
        ("bad-version", patched(8, &1u16.to_le_bytes())),
        ("bad-slot", patched(10, &(1u32 << 30).to_le_bytes())),
        ("bad-token-len", patched(18, &5000u16.to_le_bytes())),
        ("bad-ext-len", patched(20, &5000u16.to_le_bytes())),
        ("bad-truncated", with_token[..with_token.len() - 1].to_vec()),
        ("bad-trailing", [&tcp[..], b"x"].concat()),
    ]
}

/// The error text a `bad-*` preface seed must produce.
fn preface_error(name: &str) -> &'static str {
    match name {
        "bad-magic" => "not an Ibex tcp endpoint",
        "bad-short" => "at least 22",
        "bad-version" => "version 1, we speak 2",
        "bad-slot" => "slot size",
        "bad-token-len" => "auth token of 5000 bytes",
        "bad-ext-len" => "5000 bytes of tcp set-up data",
        "bad-truncated" | "bad-trailing" => "came with",
        "badshm-short-ext" => "expected 52",
        "badshm-no-credits" => "credits 0",
        "badshm-tiny-ring" => "ring",
        // Seeds added by hand (e.g. minimised fuzz findings) need only be rejected.
        _ => "",
    }
}

#[test]
fn committed_preface_seeds_decode_as_their_names_say() {
    let (mut good, mut bad) = (0, 0);
    for (name, bytes) in on_disk("preface_decode") {
        let decoded: Vec<_> = [Provider::Shm, Provider::Tcp, Provider::Verbs]
            .into_iter()
            .map(|p| (p, preface::decode(p, &bytes, "seed")))
            .collect();
        let accepted: Vec<_> = decoded.iter().filter(|d| d.1.is_ok()).collect();
        if name.starts_with("ok-") || name.starts_with("badshm-") {
            let [(provider, Ok(p))] = accepted[..] else {
                panic!("{name} should decode for exactly one provider: {decoded:?}");
            };
            assert_eq!(p.encode(*provider), bytes, "{name} does not re-encode");
            if *provider == Provider::Shm {
                let shm = ibex_transport::shm::check_peer_preface(p);
                match shm {
                    Ok(()) => assert!(name.starts_with("ok-"), "{name} passed the shm checks"),
                    Err(e) => {
                        assert!(name.starts_with("badshm-"), "{name}: {e}");
                        assert!(e.to_string().contains(preface_error(&name)), "{name}: {e}");
                        bad += 1;
                        continue;
                    }
                }
            }
            good += 1;
        } else if name.starts_with("bad-") {
            assert!(accepted.is_empty(), "{name} was accepted: {accepted:?}");
            let (_, tcp) = &decoded[1];
            let e = tcp.as_ref().expect_err("rejected").to_string();
            assert!(e.contains(preface_error(&name)), "{name}: {e}");
            bad += 1;
        } else {
            panic!("seed {name} must be named ok-*, bad-* or badshm-*");
        }
    }
    assert!(good >= 5 && bad >= 11, "{good} good and {bad} bad seeds");
}

// ---- verbs_bootstrap ---------------------------------------------------------------------

fn bootstrap_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let info = QpInfo {
        qpn: 0x11,
        psn: 0x12345,
        gid: [
            0xfe, 0x80, 0, 0, 0, 0, 0, 0, 2, 0x15, 0x5d, 0xff, 0xfe, 0x01, 0x02, 0x03,
        ],
        lid: 0,
        mtu: 3,
        recv_slots: 144,
        slot_size: 65536,
        max_rd_atom: 16,
    };
    let with = |f: fn(&mut QpInfo)| {
        let mut i = info.clone();
        f(&mut i);
        frame(&i.encode())
    };
    let ok = frame(&info.encode());
    vec![
        ("ok-qp-info", ok.clone()),
        ("ok-qp-info-ib", with(|i| i.lid = 7)),
        ("bad-huge-len", u32::MAX.to_le_bytes().to_vec()),
        ("bad-short-body", frame(&info.encode()[..41])),
        ("bad-mtu", with(|i| i.mtu = 9)),
        ("bad-qpn-zero", with(|i| i.qpn = 0)),
        ("bad-qpn-wide", with(|i| i.qpn = 1 << 24)),
        ("bad-no-recv-slots", with(|i| i.recv_slots = 0)),
        ("bad-slot", with(|i| i.slot_size = 32 << 20)),
    ]
}

fn bootstrap_error(name: &str) -> &'static str {
    match name {
        "bad-huge-len" => "not an Ibex verbs endpoint",
        "bad-short-body" => "has 41 bytes, expected 42",
        "bad-mtu" => "MTU code 9",
        "bad-qpn-zero" | "bad-qpn-wide" | "bad-no-recv-slots" => "unusable queue pair",
        "bad-slot" => "at most 16 MiB",
        _ => "",
    }
}

#[test]
fn committed_bootstrap_seeds_decode_as_their_names_say() {
    let (mut good, mut bad) = (0, 0);
    for (name, bytes) in on_disk("verbs_bootstrap") {
        let result = bytes
            .split_first_chunk::<4>()
            .ok_or_else(|| "shorter than a header".to_string())
            .and_then(|(h, rest)| {
                let len = body_len(*h).map_err(|e| e.to_string())?;
                let body = rest.get(..len).ok_or("truncated body")?;
                QpInfo::decode(body)
                    .map(|i| (i, body.to_vec()))
                    .map_err(|e| e.to_string())
            });
        if name.starts_with("ok-") {
            let (info, body) = result.unwrap_or_else(|e| panic!("{name} should decode: {e}"));
            assert_eq!(info.encode(), body, "{name} does not re-encode");
            good += 1;
        } else if name.starts_with("bad-") {
            let e = result.expect_err(&name);
            assert!(e.contains(bootstrap_error(&name)), "{name}: {e}");
            bad += 1;
        } else {
            panic!("seed {name} must be named ok-* or bad-*");
        }
    }
    assert!(good >= 2 && bad >= 7, "{good} good and {bad} bad seeds");
}

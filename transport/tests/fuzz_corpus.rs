//! Runs the committed fuzz seeds (`fuzz/seeds/frame_decode/`) through the decoder as an
//! ordinary test: `ok-*.bin` must decode and re-encode to the same bytes, `bad-*.bin` must
//! be rejected with the error its name promises. The fuzzer itself never runs here.

use std::path::{Path, PathBuf};

use bytes::Bytes;
use ibex_transport::proto::frame::{Body, Frame, FrameError, kind};

fn seed_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/frame_decode")
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
        // Seeds added by hand (e.g. minimised fuzz findings) need only be rejected.
        _ => true,
    }
}

#[test]
fn committed_seeds_decode_as_their_names_say() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(seed_dir())
        .expect("seed directory fuzz/seeds/frame_decode")
        .map(|e| e.expect("dir entry").path())
        .collect();
    files.sort();
    let (mut good, mut bad) = (0, 0);
    let mut kinds = std::collections::BTreeSet::new();
    for path in files {
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 file name")
            .to_owned();
        let bytes = Bytes::from(std::fs::read(&path).expect("read seed"));
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
    for (name, bytes) in seeds() {
        let on_disk = std::fs::read(seed_dir().join(format!("{name}.bin"))).unwrap_or_else(|e| {
            panic!("seed {name}.bin missing ({e}); run the ignored write_seeds test")
        });
        assert_eq!(
            on_disk, bytes,
            "{name}.bin is stale; run the ignored write_seeds test"
        );
    }
}

#[test]
#[ignore = "writes fuzz/seeds/frame_decode; run by hand after a wire-format change"]
fn write_seeds() {
    std::fs::create_dir_all(seed_dir()).expect("create seed dir");
    for (name, bytes) in seeds() {
        std::fs::write(seed_dir().join(format!("{name}.bin")), bytes).expect("write seed");
    }
}

//! Runs the committed seeds of the `grpc_packet` fuzz target (`fuzz/seeds/grpc_packet/`)
//! through the call demultiplexer as an ordinary test, on both sides: `ok-*.bin` must yield
//! packets that re-encode stably, `bad-*.bin` must be refused (no packet) without a panic.
//! The fuzzer itself never runs here; `fuzz/README.md` says how to run it.

use std::path::{Path, PathBuf};

use ibex_transport::fuzzing::{SECOND_PART, feed, feed_counting, split_messages};

fn seed_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/grpc_packet")
}

const HEAD: u8 = 1;
const DATA: u8 = 2;
const DATA_NEXT: u8 = 4;
const TRAILERS: u8 = 8;
const END: u8 = 16;
const RESET: u8 = 32;
const WINDOW: u8 = 64;
const GOAWAY: u8 = 128;

fn headers(h: &[(&str, &str)]) -> Vec<u8> {
    let mut v = (h.len() as u16).to_be_bytes().to_vec();
    for (n, val) in h {
        v.extend((n.len() as u16).to_be_bytes());
        v.extend(n.as_bytes());
        v.extend((val.len() as u32).to_be_bytes());
        v.extend(val.as_bytes());
    }
    v
}

fn block(b: &[u8]) -> Vec<u8> {
    let mut v = (b.len() as u32).to_be_bytes().to_vec();
    v.extend(b);
    v
}

fn request_head(path: &str) -> Vec<u8> {
    let mut h = (path.len() as u16).to_be_bytes().to_vec();
    h.extend(path.as_bytes());
    h.extend(headers(&[
        ("content-type", "application/grpc"),
        ("grpc-timeout", "10S"),
    ]));
    block(&h)
}

/// Bit 15 of a header count: the head's standard entries are implied, not written.
const IMPLIED: u16 = 0x8000;

/// A header list whose standard entries are implied: only `h` is written.
fn implied_headers(h: &[(&str, &str)]) -> Vec<u8> {
    let mut v = headers(h);
    v[0] |= (IMPLIED >> 8) as u8;
    v
}

fn response_head(status: u16) -> Vec<u8> {
    let mut h = status.to_be_bytes().to_vec();
    h.extend(headers(&[("content-type", "application/grpc")]));
    block(&h)
}

fn packet(call: u32, flags: u8, sections: &[Vec<u8>]) -> Vec<u8> {
    let mut v = call.to_be_bytes().to_vec();
    v.push(flags);
    for s in sections {
        v.extend(s);
    }
    v
}

/// Frames transport messages the way the fuzz target splits its input.
fn messages(ms: &[Vec<u8>]) -> Vec<u8> {
    let mut v = Vec::new();
    for m in ms {
        v.extend((m.len() as u16).to_be_bytes());
        v.extend(m);
    }
    v
}

/// Frames a two-part transport message (a packet and its body frame) the same way.
fn two_part(head: &[u8], body: &[u8]) -> Vec<u8> {
    let mut v = (head.len() as u16 | SECOND_PART).to_be_bytes().to_vec();
    v.extend(head);
    v.extend((body.len() as u16).to_be_bytes());
    v.extend(body);
    v
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let grpc_msg = b"\0\0\0\0\x03abc".to_vec();
    let trailers = block(&headers(&[("grpc-status", "0"), ("grpc-message", "")]));
    let ok = block(&headers(&[("grpc-status", "0")]));
    let mut many = 40000u16.to_be_bytes().to_vec();
    many.extend(std::iter::repeat_n([0u8, 1, b'h', 0, 0, 0, 0], 100).flatten());
    vec![
        (
            "ok-unary-request",
            messages(&[packet(
                1,
                HEAD | DATA | END,
                &[request_head("/pkg.Svc/Echo"), block(&grpc_msg)],
            )]),
        ),
        (
            "ok-unary-response",
            messages(&[packet(
                1,
                HEAD | DATA | TRAILERS,
                &[response_head(200), block(&grpc_msg), trailers.clone()],
            )]),
        ),
        (
            "ok-second-part-body",
            [
                two_part(
                    &packet(
                        2,
                        HEAD | DATA_NEXT,
                        &[request_head("/a/b"), 9u64.to_be_bytes().to_vec()],
                    ),
                    b"\0\0\0\0\x04wxyz",
                ),
                messages(&[packet(2, END, &[])]),
            ]
            .concat(),
        ),
        (
            // A call refused by the sender's transport: only its reset arrives.
            "ok-reset-of-an-unseen-call",
            messages(&[
                packet(3, RESET, &[]),
                packet(4, WINDOW, &[vec![0, 0, 4, 0]]),
            ]),
        ),
        (
            "ok-control",
            messages(&[
                packet(4, WINDOW, &[65536u32.to_be_bytes().to_vec()]),
                packet(0, GOAWAY, &[]),
                packet(5, RESET, &[]),
            ]),
        ),
        (
            // The same header list again and again (kept and cloned by the decoder),
            // one that differs, then the first again.
            "ok-repeated-heads",
            messages(&[
                packet(
                    1,
                    HEAD | DATA | END,
                    &[request_head("/pkg.Svc/Echo"), block(&grpc_msg)],
                ),
                packet(
                    3,
                    HEAD | DATA | END,
                    &[request_head("/pkg.Svc/Echo"), block(&grpc_msg)],
                ),
                packet(
                    5,
                    HEAD | DATA | END,
                    &[request_head("/pkg.Svc/Echo"), block(&grpc_msg)],
                ),
                packet(
                    7,
                    HEAD | END,
                    &[block(
                        &[&[0, 2, b'/', b'x'][..], &headers(&[("x-id", "7")])].concat(),
                    )],
                ),
                packet(
                    9,
                    HEAD | DATA | END,
                    &[request_head("/pkg.Svc/Echo"), block(&grpc_msg)],
                ),
            ]),
        ),
        (
            "ok-repeated-response-heads",
            messages(&[
                packet(
                    0,
                    HEAD | DATA | TRAILERS,
                    &[response_head(200), block(&grpc_msg), trailers.clone()],
                ),
                packet(
                    2,
                    HEAD | DATA | TRAILERS,
                    &[response_head(200), block(&grpc_msg), trailers.clone()],
                ),
                packet(
                    4,
                    HEAD | DATA | TRAILERS,
                    &[response_head(200), block(&grpc_msg), trailers.clone()],
                ),
            ]),
        ),
        (
            // Whole answers of direct calls (odd ids) with a lone `grpc-status: 0`
            // trailer: merged into the head's map, then kept and cloned; a head with a
            // status of its own; the same answer on an ordinary call (even id).
            "ok-whole-direct-answers",
            messages(&[
                packet(
                    1,
                    HEAD | DATA | TRAILERS,
                    &[response_head(200), block(&grpc_msg), ok.clone()],
                ),
                packet(
                    3,
                    HEAD | DATA | TRAILERS,
                    &[response_head(200), block(&grpc_msg), ok.clone()],
                ),
                packet(
                    5,
                    HEAD | DATA | TRAILERS,
                    &[response_head(200), block(&grpc_msg), ok.clone()],
                ),
                packet(
                    7,
                    HEAD | TRAILERS,
                    &[
                        block(&[&[0, 200][..], &headers(&[("grpc-status", "5")])].concat()),
                        ok.clone(),
                    ],
                ),
                packet(
                    2,
                    HEAD | DATA | TRAILERS,
                    &[response_head(200), block(&grpc_msg), ok.clone()],
                ),
            ]),
        ),
        (
            // A lone `grpc-status: 0` trailer on a direct call, spelt otherwise than the
            // usual block: decoded apart; re-encoded, it is the usual block and merges
            // (found by the fuzzer: re-encoding must stay stable through that).
            "ok-ok-trailer-spelt-otherwise",
            messages(&[packet(
                3,
                HEAD | TRAILERS,
                &[response_head(200), block(&headers(&[("grpc-Status", "0")]))],
            )]),
        ),
        (
            "bad-truncated-head",
            messages(&[packet(1, HEAD, &[vec![0, 0, 0, 40, 0, 4]])]),
        ),
        (
            "bad-40000-headers",
            messages(&[packet(1, TRAILERS, &[block(&many)])]),
        ),
        (
            // Compact heads: a request's `te` and `content-type`, a response's
            // `content-type`, implied by the count's top bit, before the entries written.
            "ok-implied-entries",
            messages(&[
                packet(
                    9,
                    HEAD | DATA | END,
                    &[
                        block(
                            &[
                                6u16.to_be_bytes().to_vec(),
                                b"/a.S/M".to_vec(),
                                implied_headers(&[("user-agent", "ua/1")]),
                            ]
                            .concat(),
                        ),
                        block(&grpc_msg),
                    ],
                ),
                packet(
                    9,
                    HEAD | DATA | TRAILERS,
                    &[
                        block(
                            &[
                                200u16.to_be_bytes().to_vec(),
                                implied_headers(&[("date", "Thu, 26 Nov 2026 16:00:00 GMT")]),
                            ]
                            .concat(),
                        ),
                        block(&grpc_msg),
                        ok.clone(),
                    ],
                ),
            ]),
        ),
        (
            // Trailers imply nothing: the mark is malformed there.
            "bad-implied-in-trailers",
            messages(&[packet(
                1,
                TRAILERS,
                &[block(&implied_headers(&[("grpc-status", "0")]))],
            )]),
        ),
        (
            "bad-both-data-kinds",
            messages(&[packet(1, DATA | DATA_NEXT, &[block(b"x"), vec![0; 8]])]),
        ),
        (
            "bad-wrong-body",
            two_part(
                &packet(6, DATA_NEXT, &[100u64.to_be_bytes().to_vec()]),
                b"short",
            ),
        ),
        (
            "bad-announced-body-missing",
            messages(&[packet(6, DATA_NEXT, &[5u64.to_be_bytes().to_vec()])]),
        ),
        (
            "bad-unannounced-second-part",
            two_part(&packet(6, END, &[]), b"extra"),
        ),
        (
            "bad-trailing-bytes",
            messages(&[packet(7, END, &[vec![0xff]])]),
        ),
    ]
}

#[test]
fn every_committed_seed_behaves_as_its_name_says() {
    let mut files: Vec<_> = std::fs::read_dir(seed_dir())
        .expect("seed dir")
        .map(|e| e.expect("dir entry").path())
        .collect();
    files.sort();
    let (mut good, mut bad) = (0, 0);
    for path in files {
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 file name")
            .to_owned();
        let msgs = split_messages(&std::fs::read(&path).expect("read seed"));
        if name.starts_with("ok-") {
            // A seed made for one side is a framing error or fine on the other; neither
            // side may panic or break the re-encoding invariant.
            let server = feed(&msgs, true).unwrap_or_else(|e| panic!("{name}: {e}"));
            let client = feed(&msgs, false).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(
                server + client > 0,
                "{name} yielded no packet on either side"
            );
            good += 1;
        } else if name.starts_with("bad-") {
            for side in [true, false] {
                assert_eq!(
                    feed(&msgs, side),
                    Ok(0),
                    "{name} should be refused before any packet"
                );
            }
            bad += 1;
        } else {
            panic!("seed {name} must be named ok-* or bad-*");
        }
    }
    assert!(good >= 5 && bad >= 5, "{good} good and {bad} bad seeds");
}

/// Whole unary packets whose head repeats are not decoded again (`Got::Repeat`); the
/// harness checks each against the general decoder's packet, and these seeds reach it on
/// both sides.
#[test]
fn repeated_whole_heads_skip_the_decoder_and_match_it() {
    let seeds: std::collections::HashMap<_, _> = seeds().into_iter().collect();
    let msgs = split_messages(&seeds["ok-repeated-heads"]);
    // The third and the fifth request: the head is kept once it came twice, and
    // a packet that is not a whole request between them does not drop it.
    assert_eq!(feed_counting(&msgs, true), Ok((5, 2)));
    let msgs = split_messages(&seeds["ok-whole-direct-answers"]);
    // The third answer; not the one with a status of its own, nor the ordinary call's.
    assert_eq!(feed_counting(&msgs, false), Ok((5, 1)));
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
#[ignore = "writes fuzz/seeds/grpc_packet; run by hand after a call-framing change"]
fn write_seeds() {
    std::fs::create_dir_all(seed_dir()).expect("create seed dir");
    for (name, bytes) in seeds() {
        std::fs::write(seed_dir().join(format!("{name}.bin")), bytes).expect("write seed");
    }
}

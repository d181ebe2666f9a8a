//! Replays the committed seeds of the `ps_request` fuzz target (`fuzz/seeds/ps_request/`)
//! through the PS's request handling as an ordinary test. Seeds run in name order against
//! one PS, so later seeds see the variables earlier ones created: `NN-ok-*` must be
//! answered OK, `NN-bad-*` must be refused with the gRPC code their name ends with.
//! The fuzzer itself never runs here (see `fuzz/README.md`).

use std::path::{Path, PathBuf};

use ibex_proto::ps::v1 as pb;
use ibex_ps::fuzzing::{feed, op};
use prost::Message;
use tonic::Code;

fn seed_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/ps_request")
}

fn var(name: &str, shape: &[u64]) -> pb::VariableDef {
    pb::VariableDef {
        name: name.into(),
        dtype: pb::Dtype::F32 as i32,
        shape: shape.to_vec(),
        init: Some(pb::Initializer {
            kind: Some(pb::initializer::Kind::Constant(1.0)),
        }),
        optimizer: Some(pb::Optimizer {
            kind: Some(pb::optimizer::Kind::Sgd(pb::Sgd { lr: 0.5 })),
        }),
        ..Default::default()
    }
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn tensor(name: &str, shape: &[u64], data: Vec<u8>) -> pb::Tensor {
    pb::Tensor {
        name: name.into(),
        dtype: pb::Dtype::F32 as i32,
        shape: shape.to_vec(),
        data: Some(pb::tensor::Data::Inline(data.into())),
    }
}

fn push(step: u64, grads: Vec<pb::Tensor>) -> pb::PushRequest {
    pb::PushRequest {
        step,
        worker: 0,
        grads,
        release: vec![],
    }
}

fn seed(op: u8, m: &impl Message) -> Vec<u8> {
    let mut v = vec![op];
    m.encode(&mut v).expect("a Vec grows");
    v
}

/// The seeds, in the order they run: (name, bytes).
fn seeds() -> Vec<(String, Vec<u8>)> {
    let create = |vars| pb::CreateVariablesRequest { vars };
    let mut emb = var("emb", &[10, 4]);
    emb.sparse = true;
    let mut part = var("big/part_1", &[2, 3]);
    part.full_shape = vec![6, 3];
    part.row_offset = 2;
    let mut overflow = var("wrap", &[2, 3]);
    overflow.full_shape = vec![6, 3];
    overflow.row_offset = u64::MAX - 1;
    let mut bad_row = var("rowlen", &[2, 3]);
    bad_row.full_shape = vec![6, 4];
    let remote = pb::Tensor {
        name: "w".into(),
        dtype: pb::Dtype::F32 as i32,
        shape: vec![4, 3],
        data: Some(pb::tensor::Data::Remote(pb::RemoteRef {
            descriptor: vec![7; 24].into(),
            len: 48,
            lease: 0,
        })),
    };
    let list: Vec<(&str, u8, Vec<u8>)> = vec![
        (
            "00-ok-create",
            op::CREATE,
            seed(
                op::CREATE,
                &create(vec![var("w", &[4, 3]), emb.clone(), part]),
            ),
        ),
        (
            "01-ok-create-sync",
            op::CREATE,
            seed(op::CREATE | op::SYNC, &create(vec![var("w", &[4, 3])])),
        ),
        (
            "02-ok-push",
            op::PUSH,
            seed(
                op::PUSH,
                &push(0, vec![tensor("w", &[4, 3], f32s(&[0.25; 12]))]),
            ),
        ),
        (
            "03-ok-pull",
            op::PULL,
            seed(
                op::PULL,
                &pb::PullRequest {
                    names: vec!["w".into()],
                    ..Default::default()
                },
            ),
        ),
        (
            "04-ok-push-pull",
            op::PUSH_PULL,
            seed(
                op::PUSH_PULL,
                &push(1, vec![tensor("w", &[4, 3], f32s(&[1.0; 12]))]),
            ),
        ),
        (
            "05-ok-lookup",
            op::LOOKUP,
            seed(
                op::LOOKUP,
                &pb::LookupRowsRequest {
                    table: "emb".into(),
                    ids: vec![0, 9, 3],
                },
            ),
        ),
        (
            "06-ok-push-sparse",
            op::PUSH_SPARSE,
            seed(
                op::PUSH_SPARSE,
                &pb::PushSparseRequest {
                    step: 2,
                    worker: 0,
                    table: "emb".into(),
                    ids: vec![1, 2],
                    grads: Some(tensor("emb", &[2, 4], f32s(&[0.5; 8]))),
                },
            ),
        ),
        (
            "07-ok-stats",
            op::STATS,
            seed(op::STATS, &pb::StatsRequest {}),
        ),
        (
            "10-bad-unknown-variable-NotFound",
            op::PUSH,
            seed(op::PUSH, &push(3, vec![tensor("nope", &[1], f32s(&[1.0]))])),
        ),
        (
            "11-bad-shape-mismatch-InvalidArgument",
            op::PUSH,
            seed(
                op::PUSH,
                &push(3, vec![tensor("w", &[3, 4], f32s(&[1.0; 12]))]),
            ),
        ),
        (
            "12-bad-short-data-InvalidArgument",
            op::PUSH,
            seed(
                op::PUSH,
                &push(3, vec![tensor("w", &[4, 3], f32s(&[1.0; 11]))]),
            ),
        ),
        (
            "13-bad-remote-without-a-connection-InvalidArgument",
            op::PUSH,
            seed(op::PUSH, &push(3, vec![remote])),
        ),
        (
            "14-bad-over-the-element-limit-ResourceExhausted",
            op::CREATE,
            seed(op::CREATE, &create(vec![var("huge", &[1 << 20, 1 << 20])])),
        ),
        (
            "14-bad-shape-product-overflows-InvalidArgument",
            op::CREATE,
            seed(op::CREATE, &create(vec![var("wrap", &[1 << 40, 1 << 40])])),
        ),
        (
            "15-bad-row-offset-overflow-InvalidArgument",
            op::CREATE,
            seed(op::CREATE, &create(vec![overflow])),
        ),
        (
            "16-bad-row-length-InvalidArgument",
            op::CREATE,
            seed(op::CREATE, &create(vec![bad_row])),
        ),
        (
            "17-bad-lookup-past-the-last-row-OutOfRange",
            op::LOOKUP,
            seed(
                op::LOOKUP,
                &pb::LookupRowsRequest {
                    table: "emb".into(),
                    ids: vec![10],
                },
            ),
        ),
        (
            "18-bad-sparse-count-InvalidArgument",
            op::PUSH_SPARSE,
            seed(
                op::PUSH_SPARSE,
                &pb::PushSparseRequest {
                    step: 3,
                    worker: 0,
                    table: "emb".into(),
                    ids: vec![1, 2, u64::MAX],
                    grads: Some(tensor("emb", &[2, 4], f32s(&[0.5; 8]))),
                },
            ),
        ),
        (
            "19-bad-empty-push-InvalidArgument",
            op::PUSH,
            seed(op::PUSH, &push(3, vec![])),
        ),
        (
            "20-bad-sync-step-never-completes-DeadlineExceeded",
            op::PULL,
            seed(
                op::PULL | op::SYNC,
                &pb::PullRequest {
                    names: vec!["w".into()],
                    step: 5,
                    ..Default::default()
                },
            ),
        ),
        (
            "21-bad-restore-without-checkpoints-FailedPrecondition",
            op::RESTORE,
            seed(op::RESTORE, &pb::RestoreRequest { step: 1 }),
        ),
    ];
    list.into_iter()
        .map(|(n, _, b)| (n.to_owned(), b))
        .collect()
}

fn on_disk() -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(seed_dir())
        .unwrap_or_else(|e| panic!("seed directory {}: {e}", seed_dir().display()))
        .map(|e| e.expect("dir entry").path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p
                .file_stem()
                .and_then(|s| s.to_str())
                .expect("utf-8 name")
                .to_owned();
            (name, std::fs::read(&p).expect("read seed"))
        })
        .collect()
}

#[test]
fn the_committed_seeds_are_the_generated_ones() {
    assert_eq!(
        on_disk(),
        seeds(),
        "regenerate with: cargo test -p ibex-ps --test fuzz_corpus -- --ignored write_seeds"
    );
}

#[test]
fn every_seed_gets_the_answer_its_name_promises() {
    let mut wrong = Vec::new();
    for (name, bytes) in on_disk() {
        let got = feed(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = if name.contains("-ok-") {
            Code::Ok
        } else {
            let code = name.rsplit('-').next().expect("a code suffix");
            [
                Code::NotFound,
                Code::InvalidArgument,
                Code::ResourceExhausted,
                Code::DeadlineExceeded,
                Code::FailedPrecondition,
                Code::OutOfRange,
            ]
            .into_iter()
            .find(|c| format!("{c:?}") == code)
            .unwrap_or_else(|| panic!("{name}: unknown code suffix {code}"))
        };
        if got != Some(want) {
            wrong.push(format!("{name}: got {got:?}"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn bytes_that_are_not_protobuf_are_ignored_not_fatal() {
    for op in 0..=255u8 {
        for body in [&[0xff_u8, 0xff, 0xff][..], &[0x0a, 0x80], &[]] {
            let mut v = vec![op];
            v.extend_from_slice(body);
            feed(&v).unwrap_or_else(|e| panic!("method byte {op:#04x}: {e}"));
        }
    }
}

#[test]
#[ignore = "writes fuzz/seeds/ps_request; run after changing the seeds"]
fn write_seeds() {
    let dir = seed_dir();
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the seed directory");
    for (name, bytes) in seeds() {
        std::fs::write(dir.join(format!("{name}.bin")), bytes).expect("write a seed");
    }
}

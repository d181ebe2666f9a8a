//! Checkpoints in safetensors: one file per shard and step,
//! `<dir>/shard-<I>/step-<S>.safetensors`, holding each variable in its storage dtype, its
//! optimizer slots (`<name>:slot<k>`, f32) and update counts (`<name>:t`, u64), with the
//! step and every variable's definition in the metadata. Files are written to a temporary
//! name and renamed, so a PS killed mid-write leaves the previous checkpoints intact. The
//! newest [`KEEP`] are kept, so after a crash all shards still share a common step.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use ibex_proto::ps::v1 as pb;
use prost::Message;
use safetensors::{Dtype as StDtype, SafeTensors, View};

use crate::shard::{Limits, Var};

/// Checkpoints kept per shard.
pub const KEEP: usize = 2;

fn shard_dir(dir: &Path, shard: u32) -> PathBuf {
    dir.join(format!("shard-{shard}"))
}

fn file(dir: &Path, shard: u32, step: u64) -> PathBuf {
    shard_dir(dir, shard).join(format!("step-{step:012}.safetensors"))
}

/// Steps of the complete checkpoints of `shard`, oldest first.
pub fn list(dir: &Path, shard: u32) -> Vec<u64> {
    let Ok(rd) = std::fs::read_dir(shard_dir(dir, shard)) else {
        return Vec::new();
    };
    let mut steps: Vec<u64> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let n = e.file_name().into_string().ok()?;
            n.strip_prefix("step-")?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()
        })
        .collect();
    steps.sort_unstable();
    steps
}

struct Raw {
    dtype: StDtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Raw {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err("odd-length hex".into());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| e.to_string()))
        .collect()
}

/// Writes the checkpoint of `step` and prunes old ones; returns its path.
pub(crate) fn save(dir: &Path, shard: u32, step: u64, vars: &[&Var]) -> Result<PathBuf, String> {
    let sdir = shard_dir(dir, shard);
    std::fs::create_dir_all(&sdir).map_err(|e| format!("{}: {e}", sdir.display()))?;
    let mut tensors: Vec<(String, Raw)> = Vec::new();
    let mut meta = HashMap::new();
    meta.insert("step".to_string(), step.to_string());
    meta.insert("shard".to_string(), shard.to_string());
    for v in vars {
        let name = &v.def.name;
        meta.insert(format!("var:{name}"), hex(&v.def.encode_to_vec()));
        let (dtype, data) = match pb::Dtype::try_from(v.def.dtype) {
            Ok(pb::Dtype::F16) => (
                StDtype::F16,
                v.data
                    .iter()
                    .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                    .collect(),
            ),
            Ok(pb::Dtype::Bf16) => (
                StDtype::BF16,
                v.data
                    .iter()
                    .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                    .collect(),
            ),
            _ => (StDtype::F32, f32_bytes(&v.data)),
        };
        tensors.push((
            name.clone(),
            Raw {
                dtype,
                shape: v.shape.clone(),
                data,
            },
        ));
        for (k, s) in v.slots.iter().enumerate() {
            tensors.push((
                format!("{name}:slot{k}"),
                Raw {
                    dtype: StDtype::F32,
                    shape: v.shape.clone(),
                    data: f32_bytes(s),
                },
            ));
        }
        tensors.push((
            format!("{name}:t"),
            Raw {
                dtype: StDtype::U64,
                shape: vec![v.t.len()],
                data: v.t.iter().flat_map(|x| x.to_le_bytes()).collect(),
            },
        ));
    }
    let bytes = safetensors::serialize(tensors.iter().map(|(n, r)| (n.as_str(), r)), Some(meta))
        .map_err(|e| e.to_string())?;
    let path = file(dir, shard, step);
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    f.write_all(&bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))?;
    let steps = list(dir, shard);
    for old in steps.iter().take(steps.len().saturating_sub(KEEP)) {
        // A failed prune only costs disk space.
        let _ = std::fs::remove_file(file(dir, shard, *old));
    }
    Ok(path)
}

/// Reads the checkpoint of `step`: the step and the variables.
pub(crate) fn load(
    dir: &Path,
    shard: u32,
    step: u64,
    limits: &Limits,
) -> Result<(u64, BTreeMap<String, Var>), String> {
    let path = file(dir, shard, step);
    let ctx = |e: String| format!("{}: {e}", path.display());
    let buf = std::fs::read(&path).map_err(|e| ctx(e.to_string()))?;
    let (_, md) = SafeTensors::read_metadata(&buf).map_err(|e| ctx(e.to_string()))?;
    let st = SafeTensors::deserialize(&buf).map_err(|e| ctx(e.to_string()))?;
    let meta = md.metadata().clone().unwrap_or_default();
    let saved: u64 = meta
        .get("step")
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ctx("no step in the metadata".into()))?;
    let mut vars = BTreeMap::new();
    for (k, val) in &meta {
        let Some(name) = k.strip_prefix("var:") else {
            continue;
        };
        let def = pb::VariableDef::decode(unhex(val).map_err(&ctx)?.as_slice())
            .map_err(|e| ctx(e.to_string()))?;
        let mut v = Var::new(def, limits).map_err(|s| ctx(s.message().to_string()))?;
        let t = st.tensor(name).map_err(|e| ctx(format!("{name}: {e}")))?;
        let data: Vec<f32> = match t.dtype() {
            StDtype::F16 => t
                .data()
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            StDtype::BF16 => t
                .data()
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => read_f32(t.data()),
        };
        if data.len() != v.data.len() {
            return Err(ctx(format!(
                "{name} has {} values, its definition {}",
                data.len(),
                v.data.len()
            )));
        }
        v.data = data;
        for k in 0..v.slots.len() {
            let s = st
                .tensor(&format!("{name}:slot{k}"))
                .map_err(|e| ctx(format!("{name}:slot{k}: {e}")))?;
            let s = read_f32(s.data());
            if s.len() != v.data.len() {
                return Err(ctx(format!("{name}:slot{k} has the wrong length")));
            }
            v.slots[k] = s;
        }
        let t = st
            .tensor(&format!("{name}:t"))
            .map_err(|e| ctx(format!("{name}:t: {e}")))?;
        let t: Vec<u64> = t
            .data()
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect();
        if t.len() != v.t.len() {
            return Err(ctx(format!("{name}:t has the wrong length")));
        }
        v.t = t;
        vars.insert(name.to_string(), v);
    }
    Ok((saved, vars))
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    ibex_proto::tensor::f32_to_le_vec(v)
}

fn read_f32(b: &[u8]) -> Vec<f32> {
    ibex_proto::tensor::f32_from_le_bytes(b)
}

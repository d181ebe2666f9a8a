//! Datasets: the UCI digits CSV shipped in `data/digits/` (embedded in the binary) and MNIST
//! IDX files, with a seeded train/test split and the per-step minibatch schedule.

use std::io::Read;
use std::path::Path;

use crate::rng::SplitMix64;

/// The digits CSV from scikit-learn (see `data/digits/README.md`), embedded so that `ibex`
/// runs from any directory.
static DIGITS_CSV_GZ: &[u8] = include_bytes!("../../data/digits/digits.csv.gz");

/// Examples with features scaled to [0, 1].
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Row-major `len() x dim` features.
    pub x: Vec<f32>,
    /// One label in `0..classes` per example.
    pub y: Vec<u8>,
    /// Features per example.
    pub dim: usize,
    /// Number of classes.
    pub classes: usize,
}

impl Dataset {
    /// Number of examples.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// The features of example `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.x[i * self.dim..(i + 1) * self.dim]
    }

    /// The examples at `idx`, in that order.
    pub fn gather(&self, idx: &[usize]) -> Dataset {
        let mut x = Vec::with_capacity(idx.len() * self.dim);
        for &i in idx {
            x.extend_from_slice(self.row(i));
        }
        Dataset {
            x,
            y: idx.iter().map(|&i| self.y[i]).collect(),
            dim: self.dim,
            classes: self.classes,
        }
    }

    /// A seeded shuffle into `(train, test)` with `test_size` test examples.
    pub fn split(&self, seed: u64, test_size: usize) -> Result<(Dataset, Dataset), String> {
        if test_size == 0 || test_size >= self.len() {
            return Err(format!(
                "test size {test_size} must be in 1..{}",
                self.len()
            ));
        }
        let perm = SplitMix64::new(seed).permutation(self.len());
        let (test, train) = perm.split_at(test_size);
        Ok((self.gather(train), self.gather(test)))
    }
}

/// The embedded UCI digits set: 1797 8x8 images, pixels 0..16 scaled to [0, 1].
pub fn digits() -> Result<Dataset, String> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(DIGITS_CSV_GZ)
        .read_to_string(&mut text)
        .map_err(|e| format!("embedded digits.csv.gz is corrupt: {e}"))?;
    parse_digits_csv(&text)
}

/// Rows of 64 pixel counts (0..16) followed by the label.
fn parse_digits_csv(text: &str) -> Result<Dataset, String> {
    let mut x = Vec::new();
    let mut y = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let vals: Vec<&str> = line.split(',').collect();
        if vals.len() != 65 {
            return Err(format!(
                "digits line {}: {} fields, expected 64 pixels and a label",
                n + 1,
                vals.len()
            ));
        }
        for v in &vals[..64] {
            let p: f32 = v
                .trim()
                .parse()
                .map_err(|_| format!("digits line {}: pixel {v:?} is not a number", n + 1))?;
            x.push(p / 16.0);
        }
        let label: u8 = vals[64]
            .trim()
            .parse()
            .map_err(|_| format!("digits line {}: bad label", n + 1))?;
        if label > 9 {
            return Err(format!(
                "digits line {}: label {label} is not a digit",
                n + 1
            ));
        }
        y.push(label);
    }
    Ok(Dataset {
        x,
        y,
        dim: 64,
        classes: 10,
    })
}

/// MNIST from `dir`: `train-images-idx3-ubyte` and `train-labels-idx1-ubyte` plus the
/// `t10k-*` pair when present (each optionally `.gz`), concatenated; pixels scaled to [0, 1].
/// The split is then done by [`Dataset::split`] like for digits.
pub fn mnist(dir: &Path) -> Result<Dataset, String> {
    let mut all: Option<Dataset> = None;
    for prefix in ["train", "t10k"] {
        let images = read_maybe_gz(dir, &format!("{prefix}-images-idx3-ubyte"));
        let labels = read_maybe_gz(dir, &format!("{prefix}-labels-idx1-ubyte"));
        let (images, labels) = match (images, labels) {
            (Ok(Some(i)), Ok(Some(l))) => (i, l),
            (Ok(None), Ok(None)) if prefix == "t10k" => break,
            (Ok(None), Ok(None)) => {
                return Err(format!(
                    "no MNIST files in {}: expected train-images-idx3-ubyte and train-labels-idx1-ubyte (optionally .gz)",
                    dir.display()
                ));
            }
            (Err(e), _) | (_, Err(e)) => return Err(e),
            _ => {
                return Err(format!(
                    "{}: {prefix}-images-idx3-ubyte and {prefix}-labels-idx1-ubyte must both exist",
                    dir.display()
                ));
            }
        };
        let part = parse_idx(&images, &labels)
            .map_err(|e| format!("{}: {prefix} files: {e}", dir.display()))?;
        match &mut all {
            None => all = Some(part),
            Some(a) => {
                a.x.extend(part.x);
                a.y.extend(part.y);
            }
        }
    }
    all.ok_or_else(|| format!("no MNIST files in {}", dir.display()))
}

fn read_maybe_gz(dir: &Path, name: &str) -> Result<Option<Vec<u8>>, String> {
    let plain = dir.join(name);
    let gz = dir.join(format!("{name}.gz"));
    if let Ok(b) = std::fs::read(&plain) {
        return Ok(Some(b));
    }
    match std::fs::read(&gz) {
        Ok(b) => {
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(&b[..])
                .read_to_end(&mut out)
                .map_err(|e| format!("{}: {e}", gz.display()))?;
            Ok(Some(out))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", gz.display())),
    }
}

/// IDX: big-endian magic `0x0000_08_<ndims>`, the dimensions, then unsigned bytes.
fn parse_idx(images: &[u8], labels: &[u8]) -> Result<Dataset, String> {
    let be = |b: &[u8], at: usize| -> Result<usize, String> {
        b.get(at..at + 4)
            .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]) as usize)
            .ok_or_else(|| "truncated header".to_string())
    };
    if be(images, 0)? != 0x0803 {
        return Err("images: magic is not 0x00000803 (ubyte, 3 dims)".into());
    }
    if be(labels, 0)? != 0x0801 {
        return Err("labels: magic is not 0x00000801 (ubyte, 1 dim)".into());
    }
    let (n, rows, cols) = (be(images, 4)?, be(images, 8)?, be(images, 12)?);
    let dim = rows.checked_mul(cols).ok_or("image size overflows")?;
    let need = n
        .checked_mul(dim)
        .and_then(|v| v.checked_add(16))
        .ok_or("image count overflows")?;
    if images.len() != need {
        return Err(format!(
            "images: {} bytes, the header promises {need}",
            images.len()
        ));
    }
    if be(labels, 4)? != n || labels.len() != 8 + n {
        return Err(format!("labels: count does not match the {n} images"));
    }
    let y = labels[8..].to_vec();
    if let Some(bad) = y.iter().find(|&&l| l > 9) {
        return Err(format!("labels: {bad} is not a digit"));
    }
    let x = images[16..].iter().map(|&p| f32::from(p) / 255.0).collect();
    Ok(Dataset {
        x,
        y,
        dim,
        classes: 10,
    })
}

/// Which training examples make up each step's minibatch. It depends only on the seed and
/// the step, so a worker that resumes at step k after a PS restart sees exactly the batch
/// it would have seen, and no example order is lost or repeated.
#[derive(Debug, Clone)]
pub struct Schedule {
    order: Vec<usize>,
    batch: usize,
}

impl Schedule {
    /// Cycles through one seeded permutation of `n` examples, `batch` at a time.
    pub fn new(n: usize, batch: usize, seed: u64) -> Schedule {
        Schedule {
            order: SplitMix64::new(seed ^ 0x5EED_BA7C).permutation(n),
            batch,
        }
    }

    /// The examples of step `step` that worker `worker` of `workers` computes on: its
    /// contiguous `batch / workers` share of the step's minibatch.
    pub fn shard(&self, step: u64, worker: usize, workers: usize) -> Vec<usize> {
        let per = self.batch / workers;
        let n = self.order.len();
        let start = (step as usize).wrapping_mul(self.batch) % n;
        (worker * per..(worker + 1) * per)
            .map(|j| self.order[(start + j) % n])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_load_and_split() {
        let d = digits().unwrap();
        assert_eq!((d.len(), d.dim), (1797, 64));
        assert!(d.x.iter().all(|&v| (0.0..=1.0).contains(&v)));
        assert_eq!(d.y[..3], [0, 1, 2]);
        let (tr, te) = d.split(7, 300).unwrap();
        assert_eq!((tr.len(), te.len()), (1497, 300));
        let (tr2, _) = d.split(7, 300).unwrap();
        assert_eq!(tr.y, tr2.y);
        assert!(d.split(7, 0).is_err());
    }

    #[test]
    fn bad_csv_is_an_error() {
        assert!(
            parse_digits_csv("1,2,3\n")
                .unwrap_err()
                .contains("3 fields")
        );
        let row = format!("{}12", "0,".repeat(64));
        assert!(parse_digits_csv(&row).unwrap_err().contains("not a digit"));
    }

    #[test]
    fn idx_round_trip_and_errors() {
        let mut img = vec![0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 2];
        img.extend([0, 255, 51, 0, 1, 2, 3, 4]);
        let lab = vec![0, 0, 8, 1, 0, 0, 0, 2, 7, 3];
        let d = parse_idx(&img, &lab).unwrap();
        assert_eq!((d.len(), d.dim, d.y.clone()), (2, 4, vec![7, 3]));
        assert_eq!(d.row(0), &[0.0, 1.0, 0.2, 0.0]);
        assert!(parse_idx(&img[..20], &lab).unwrap_err().contains("bytes"));
        assert!(parse_idx(&img, &lab[..9]).unwrap_err().contains("count"));
        assert!(parse_idx(&lab, &lab).unwrap_err().contains("magic"));
    }

    #[test]
    fn mnist_dir_reads_gz() {
        let dir = std::env::temp_dir().join(format!("ibex-mnist-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut img = vec![0, 0, 8, 3, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 2, 9, 9];
        let lab = vec![0, 0, 8, 1, 0, 0, 0, 1, 5];
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &img).unwrap();
        std::fs::write(dir.join("train-images-idx3-ubyte.gz"), gz.finish().unwrap()).unwrap();
        std::fs::write(dir.join("train-labels-idx1-ubyte"), &lab).unwrap();
        let d = mnist(&dir).unwrap();
        assert_eq!((d.len(), d.dim, d.y[0]), (1, 2, 5));
        img.truncate(17);
        std::fs::write(dir.join("train-images-idx3-ubyte"), &img).unwrap();
        assert!(mnist(&dir).unwrap_err().contains("bytes"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(mnist(&dir).unwrap_err().contains("no MNIST files"));
    }

    #[test]
    fn shards_partition_the_step_batch() {
        let s = Schedule::new(100, 8, 1);
        let full: Vec<usize> = s.shard(13, 0, 1);
        let halves: Vec<usize> = [s.shard(13, 0, 2), s.shard(13, 1, 2)].concat();
        assert_eq!(full, halves);
        assert_ne!(s.shard(13, 0, 1), s.shard(14, 0, 1));
    }
}

//! The connect-time threshold probe: measures eager and rendezvous round trips at a few
//! sizes on the real link and picks the eager threshold where eager stops winning.
//!
//! Samples run one at a time so they do not queue behind each other: for each size, a
//! warm-up plus `reps` `ProbeEager` samples (the peer answers `ProbeAck`), then the same for
//! `ProbeRts` (the peer reads the probe buffer like any rendezvous and answers
//! `RndvDone` with the PROBE flag). A sample's cost is the time from the `poll_transmit`
//! that emitted it to the handling of its answer; a size's cost is the minimum over its
//! reps (the minimum filters out scheduling noise better than a mean).
//!
//! The decision itself is the pure function [`choose_threshold`]; [`Probe`] is only the
//! bookkeeping around it, driven by the connection.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::Protocol;

/// How long a probe may take before it is abandoned (the default threshold stays).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Sizes and repetitions the probe measures.
#[derive(Debug, Clone)]
pub struct ProbePlan {
    /// Candidate thresholds, ascending.
    pub sizes: Vec<usize>,
    /// Samples per size and protocol.
    pub reps: usize,
}

impl ProbePlan {
    /// The standard plan: 1 KiB, 4 KiB, 16 KiB and `max_eager` (the largest message that
    /// fits one of the peer's slots), deduplicated, ascending, none above `max_eager`;
    /// 3 counted reps after one warm-up.
    pub fn default_for(max_eager: usize) -> ProbePlan {
        let mut sizes: Vec<usize> = [1024, 4096, 16 * 1024, max_eager]
            .into_iter()
            .filter(|&s| s <= max_eager && s > 0)
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        ProbePlan { sizes, reps: 3 }
    }
}

/// Measured cost of one candidate size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeCost {
    /// The candidate size.
    pub size: usize,
    /// Best eager round trip.
    pub eager: Duration,
    /// Best rendezvous round trip.
    pub rendezvous: Duration,
}

/// The probe's decision: the largest candidate size at which eager costs no more than
/// rendezvous; if eager loses even at the smallest size, the smallest size (small messages
/// must go eager anyway: a rendezvous round trip per tiny message never pays off in
/// practice, the probe just could not measure it). `None` for no candidates.
pub fn choose_threshold(costs: &[SizeCost]) -> Option<usize> {
    let smallest = costs.iter().map(|c| c.size).min()?;
    let best = costs
        .iter()
        .filter(|c| c.eager <= c.rendezvous)
        .map(|c| c.size)
        .max();
    Some(best.unwrap_or(smallest))
}

/// One sample to take.
#[derive(Debug, Clone, Copy)]
struct Step {
    size_idx: usize,
    proto: Protocol,
    counted: bool,
}

/// A probe sample ready to go out.
#[derive(Debug, Clone)]
pub(crate) enum Sample {
    Eager {
        probe_id: u32,
        pad: Bytes,
    },
    Rts {
        probe_id: u32,
        len: u64,
        desc: Bytes,
    },
}

/// The probe's bookkeeping on the measuring side.
#[derive(Debug)]
pub(crate) struct Probe {
    plan: ProbePlan,
    steps: Vec<Step>,
    next_step: usize,
    /// The sample on the wire: id, protocol, `now` when it went out.
    in_flight: Option<(u32, Protocol, Instant)>,
    next_id: u32,
    eager_min: Vec<Option<Duration>>,
    rndv_min: Vec<Option<Duration>>,
    desc: Bytes,
    pad: Bytes,
    pub(crate) deadline: Instant,
    /// Stop taking samples (timed out or closing); finish once no rendezvous sample is out.
    pub(crate) abandoned: bool,
}

/// What handling an answer led to.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Progress {
    /// More samples to take (or the answer was stale).
    Running,
    /// All samples taken: this threshold.
    Done(usize),
    /// Abandoned and nothing in flight any more.
    Abandoned,
}

impl Probe {
    pub(crate) fn new(plan: ProbePlan, desc: Bytes, now: Instant, timeout: Duration) -> Probe {
        let mut steps = Vec::new();
        for size_idx in 0..plan.sizes.len() {
            for proto in [Protocol::Eager, Protocol::Rendezvous] {
                steps.push(Step {
                    size_idx,
                    proto,
                    counted: false,
                });
                steps.extend((0..plan.reps).map(|_| Step {
                    size_idx,
                    proto,
                    counted: true,
                }));
            }
        }
        let max = plan.sizes.iter().copied().max().unwrap_or(0);
        let n = plan.sizes.len();
        Probe {
            plan,
            steps,
            next_step: 0,
            in_flight: None,
            next_id: 0,
            eager_min: vec![None; n],
            rndv_min: vec![None; n],
            desc,
            pad: Bytes::from(vec![0u8; max]),
            deadline: now + timeout,
            abandoned: false,
        }
    }

    /// The next sample if one may go out now (none in flight, not abandoned, steps left).
    pub(crate) fn next_sample(&self) -> Option<Sample> {
        if self.abandoned || self.in_flight.is_some() {
            return None;
        }
        let step = self.steps.get(self.next_step)?;
        let size = self.plan.sizes[step.size_idx];
        let probe_id = self.next_id;
        Some(match step.proto {
            Protocol::Eager => Sample::Eager {
                probe_id,
                pad: self.pad.slice(..size),
            },
            Protocol::Rendezvous => Sample::Rts {
                probe_id,
                len: size as u64,
                desc: self.desc.clone(),
            },
        })
    }

    /// The sample from [`Probe::next_sample`] went out at `now`.
    pub(crate) fn sent(&mut self, now: Instant) {
        if let Some(step) = self.steps.get(self.next_step) {
            self.in_flight = Some((self.next_id, step.proto, now));
            self.next_id = self.next_id.wrapping_add(1);
        }
    }

    /// The answer to sample `probe_id` (of protocol `proto`) arrived at `now`.
    pub(crate) fn answered(&mut self, now: Instant, probe_id: u32, proto: Protocol) -> Progress {
        match self.in_flight {
            Some((id, p, sent)) if id == probe_id && p == proto => {
                self.in_flight = None;
                if !self.abandoned {
                    let step = self.steps[self.next_step];
                    if step.counted {
                        let rtt = now.saturating_duration_since(sent);
                        let slot = match proto {
                            Protocol::Eager => &mut self.eager_min[step.size_idx],
                            Protocol::Rendezvous => &mut self.rndv_min[step.size_idx],
                        };
                        *slot = Some(slot.map_or(rtt, |m| m.min(rtt)));
                    }
                    self.next_step += 1;
                }
            }
            _ => return Progress::Running,
        }
        self.progress()
    }

    /// Gives up taking samples (deadline or close).
    pub(crate) fn abandon(&mut self) -> Progress {
        self.abandoned = true;
        self.progress()
    }

    fn progress(&self) -> Progress {
        if self.abandoned {
            // The peer may be reading the probe buffer: the driver must not withdraw it
            // before the answer. An eager sample in flight holds nothing of ours.
            let rts_out = matches!(self.in_flight, Some((_, Protocol::Rendezvous, _)));
            return if rts_out {
                Progress::Running
            } else {
                Progress::Abandoned
            };
        }
        if self.next_step < self.steps.len() {
            return Progress::Running;
        }
        let costs: Vec<SizeCost> = self
            .plan
            .sizes
            .iter()
            .zip(self.eager_min.iter().zip(&self.rndv_min))
            .filter_map(|(&size, (e, r))| {
                Some(SizeCost {
                    size,
                    eager: (*e)?,
                    rendezvous: (*r)?,
                })
            })
            .collect();
        match choose_threshold(&costs) {
            Some(t) => Progress::Done(t),
            None => Progress::Abandoned,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(size: usize, eager_us: u64, rndv_us: u64) -> SizeCost {
        SizeCost {
            size,
            eager: Duration::from_micros(eager_us),
            rendezvous: Duration::from_micros(rndv_us),
        }
    }

    #[test]
    fn default_plan_sizes() {
        assert_eq!(
            ProbePlan::default_for(65518).sizes,
            vec![1024, 4096, 16384, 65518]
        );
        assert_eq!(ProbePlan::default_for(16384).sizes, vec![1024, 4096, 16384]);
        assert_eq!(ProbePlan::default_for(3000).sizes, vec![1024, 3000]);
        assert_eq!(ProbePlan::default_for(500).sizes, vec![500]);
        assert_eq!(ProbePlan::default_for(65518).reps, 3);
    }

    #[test]
    fn picks_the_largest_size_where_eager_still_wins() {
        let c = [
            cost(1024, 5, 20),
            cost(4096, 8, 20),
            cost(16384, 25, 22),
            cost(65518, 90, 30),
        ];
        assert_eq!(choose_threshold(&c), Some(4096));
    }

    #[test]
    fn eager_winning_everywhere_gives_the_largest() {
        let c = [cost(1024, 5, 50), cost(4096, 8, 50), cost(65518, 40, 50)];
        assert_eq!(choose_threshold(&c), Some(65518));
    }

    #[test]
    fn eager_losing_everywhere_gives_the_smallest() {
        let c = [cost(1024, 50, 5), cost(4096, 80, 5)];
        assert_eq!(choose_threshold(&c), Some(1024));
    }

    #[test]
    fn a_tie_goes_to_eager() {
        assert_eq!(
            choose_threshold(&[cost(1024, 5, 5), cost(4096, 9, 8)]),
            Some(1024)
        );
    }

    #[test]
    fn no_candidates_no_decision() {
        assert_eq!(choose_threshold(&[]), None);
    }

    #[test]
    fn bookkeeping_takes_min_over_counted_reps() {
        let t0 = Instant::now();
        let plan = ProbePlan {
            sizes: vec![100, 200],
            reps: 2,
        };
        let mut p = Probe::new(plan, Bytes::from_static(b"d"), t0, PROBE_TIMEOUT);
        let mut now = t0;
        let mut last = Progress::Running;
        let mut n = 0;
        while let Some(s) = p.next_sample() {
            p.sent(now);
            let (id, proto, rtt) = match s {
                // Eager is cheap at 100 and dear at 200; the warm-up (first of each) is slow.
                Sample::Eager { probe_id, pad } => (
                    probe_id,
                    Protocol::Eager,
                    if pad.len() == 100 { 10 } else { 50 },
                ),
                Sample::Rts { probe_id, .. } => (probe_id, Protocol::Rendezvous, 30),
            };
            let rtt = if n % 3 == 0 { 1000 } else { rtt };
            n += 1;
            now += Duration::from_micros(rtt);
            last = p.answered(now, id, proto);
        }
        assert_eq!(n, 12);
        assert_eq!(last, Progress::Done(100));
    }

    #[test]
    fn abandoning_waits_for_a_rendezvous_sample_in_flight() {
        let t0 = Instant::now();
        let mut p = Probe::new(
            ProbePlan {
                sizes: vec![100],
                reps: 0,
            },
            Bytes::new(),
            t0,
            PROBE_TIMEOUT,
        );
        assert!(matches!(
            p.next_sample(),
            Some(Sample::Eager { probe_id: 0, .. })
        ));
        p.sent(t0);
        assert_eq!(p.answered(t0, 0, Protocol::Eager), Progress::Running);
        assert!(matches!(
            p.next_sample(),
            Some(Sample::Rts {
                probe_id: 1,
                len: 100,
                ..
            })
        ));
        p.sent(t0);
        assert_eq!(p.abandon(), Progress::Running);
        assert!(p.next_sample().is_none());
        assert_eq!(p.answered(t0, 1, Protocol::Rendezvous), Progress::Abandoned);
    }

    #[test]
    fn abandoning_with_an_eager_sample_out_is_immediate() {
        let t0 = Instant::now();
        let mut p = Probe::new(
            ProbePlan {
                sizes: vec![100],
                reps: 1,
            },
            Bytes::new(),
            t0,
            PROBE_TIMEOUT,
        );
        assert!(p.next_sample().is_some());
        p.sent(t0);
        assert_eq!(p.abandon(), Progress::Abandoned);
    }
}

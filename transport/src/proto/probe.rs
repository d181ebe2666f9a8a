//! The connect-time probe: measures the real link and picks the eager threshold and the
//! rendezvous fragment size.
//!
//! Samples run one at a time so they do not queue behind each other. A sample's cost is the
//! time from the `poll_transmit` that emitted it to the handling of its answer; a
//! candidate's cost is the minimum over its counted samples (the minimum filters out
//! scheduling noise better than a mean).
//!
//! 1. Threshold: for each size, a warm-up plus `reps` `ProbeEager` samples (the peer
//!    answers `ProbeAck`), then the same for `ProbeRts` (the peer reads the probe buffer
//!    like any rendezvous and answers `RndvDone` with the PROBE flag).
//! 2. Fragment size, when the peer announced `ProbeRead` and the fragment size is left to
//!    the probe: one warm-up, then `fragment_reps` rounds over the candidates, each a
//!    `ProbeRead` of `fragment_len` bytes that the peer reads in fragments of the candidate
//!    size with its usual reads in flight. The length is the same for every candidate, so
//!    the fastest round trip is the highest read bandwidth. Rounds interleave the candidates
//!    so that a slow spell of the machine does not land on one candidate only.
//!
//! The measurement is of the peer reading from us; the verdict is applied to our own reads,
//! which assumes a symmetric link (both ends alike), as the threshold probe does.
//!
//! The decisions are the pure functions [`choose_threshold`] and [`choose_fragment`];
//! [`Probe`] is only the bookkeeping around them, driven by the connection.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::Protocol;

/// How long a probe may take before it is abandoned (what it finished measuring stands,
/// the rest keeps its default). Counted from the handshake.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Bytes each fragment-size sample reads: large enough that the largest candidate still
/// takes four reads (so reads in flight overlap), small enough that the whole phase moves
/// 44 MiB (milliseconds on RDMA or shared memory).
pub const FRAGMENT_PROBE_LEN: usize = 4 << 20;

/// Candidate fragment sizes.
pub const FRAGMENT_CANDIDATES: [usize; 5] = [64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20];

/// A fragment whose time is within this many percent of the best one's counts as a tie.
const FRAGMENT_TIE_PERCENT: u128 = 5;

/// Sizes and repetitions the probe measures.
#[derive(Debug, Clone)]
pub struct ProbePlan {
    /// Candidate thresholds, ascending.
    pub sizes: Vec<usize>,
    /// Samples per size and protocol.
    pub reps: usize,
    /// Candidate fragment sizes, ascending; empty = the fragment size is not probed.
    pub fragments: Vec<usize>,
    /// Bytes each fragment sample reads.
    pub fragment_len: usize,
    /// Counted rounds over the fragment candidates (after one warm-up sample).
    pub fragment_reps: usize,
}

impl ProbePlan {
    /// The standard threshold plan: 1 KiB, 4 KiB, 16 KiB and `max_eager` (the largest
    /// message that fits one of the peer's slots), deduplicated, ascending, none above
    /// `max_eager`; 3 counted reps after one warm-up. No fragment phase.
    pub fn default_for(max_eager: usize) -> ProbePlan {
        let mut sizes: Vec<usize> = [1024, 4096, 16 * 1024, max_eager]
            .into_iter()
            .filter(|&s| s <= max_eager && s > 0)
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        ProbePlan {
            sizes,
            reps: 3,
            fragments: Vec::new(),
            fragment_len: 0,
            fragment_reps: 0,
        }
    }

    /// Adds the standard fragment phase over `len`-byte samples: the candidates of
    /// [`FRAGMENT_CANDIDATES`] that a `len`-byte read covers at least four times, two
    /// counted rounds.
    pub fn with_fragments(mut self, len: usize) -> ProbePlan {
        self.fragments = FRAGMENT_CANDIDATES
            .into_iter()
            .filter(|&f| f.saturating_mul(4) <= len)
            .collect();
        self.fragment_len = len;
        self.fragment_reps = 2;
        self
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

/// Measured cost of one candidate fragment size: the best time to read the same sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FragmentCost {
    /// The candidate fragment size.
    pub fragment: usize,
    /// Best round trip of a sample read in fragments of this size.
    pub time: Duration,
}

/// The fragment decision: the smallest candidate whose time is within 5% of the fastest.
/// Below that margin the difference is noise on a busy host, and the smaller fragment is
/// worth having: it holds less memory per read in flight and lets the reads of consecutive
/// messages interleave more finely. `None` for no candidates.
pub fn choose_fragment(costs: &[FragmentCost]) -> Option<usize> {
    let best = costs.iter().map(|c| c.time.as_nanos()).min()?;
    costs
        .iter()
        .filter(|c| c.time.as_nanos() * 100 <= best * (100 + FRAGMENT_TIE_PERCENT))
        .map(|c| c.fragment)
        .min()
}

/// One sample to take.
#[derive(Debug, Clone, Copy)]
enum Step {
    Threshold {
        size_idx: usize,
        proto: Protocol,
        counted: bool,
    },
    Fragment {
        frag_idx: usize,
        counted: bool,
    },
}

impl Step {
    /// The protocol whose answer ends the sample (`RndvDone` for every read sample).
    fn proto(&self) -> Protocol {
        match self {
            Step::Threshold { proto, .. } => *proto,
            Step::Fragment { .. } => Protocol::Rendezvous,
        }
    }
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
    Read {
        probe_id: u32,
        len: u64,
        fragment: u32,
        desc: Bytes,
    },
}

/// What the probe found; `None` where it has no verdict (not probed, or abandoned first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Verdict {
    pub threshold: Option<usize>,
    pub fragment: Option<usize>,
}

/// The probe's bookkeeping on the measuring side.
#[derive(Debug)]
pub(crate) struct Probe {
    plan: ProbePlan,
    steps: Vec<Step>,
    /// Steps of the threshold phase (they come first).
    threshold_steps: usize,
    next_step: usize,
    /// The sample on the wire: id, protocol, `now` when it went out.
    in_flight: Option<(u32, Protocol, Instant)>,
    next_id: u32,
    eager_min: Vec<Option<Duration>>,
    rndv_min: Vec<Option<Duration>>,
    frag_min: Vec<Option<Duration>>,
    desc: Bytes,
    pad: Bytes,
    pub(crate) deadline: Instant,
    /// Stop taking samples (timed out or closing); finish once no rendezvous sample is out.
    pub(crate) abandoned: bool,
}

/// What handling an answer led to.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Progress {
    /// More samples to take (or the answer was stale, or an abandoned probe still has a
    /// read sample out).
    Running,
    /// No more samples: the verdict (complete, or what an abandoned probe had finished).
    Finished(Verdict),
}

impl Probe {
    pub(crate) fn new(plan: ProbePlan, desc: Bytes, now: Instant, timeout: Duration) -> Probe {
        let mut steps = Vec::new();
        for size_idx in 0..plan.sizes.len() {
            for proto in [Protocol::Eager, Protocol::Rendezvous] {
                steps.push(Step::Threshold {
                    size_idx,
                    proto,
                    counted: false,
                });
                steps.extend((0..plan.reps).map(|_| Step::Threshold {
                    size_idx,
                    proto,
                    counted: true,
                }));
            }
        }
        let threshold_steps = steps.len();
        if let Some(last) = plan.fragments.len().checked_sub(1) {
            // The warm-up pays for first-touch costs (the reader registering its receive
            // memory, page faults) that no candidate should be charged with.
            steps.push(Step::Fragment {
                frag_idx: last,
                counted: false,
            });
            for _ in 0..plan.fragment_reps {
                steps.extend((0..plan.fragments.len()).map(|frag_idx| Step::Fragment {
                    frag_idx,
                    counted: true,
                }));
            }
        }
        let max = plan.sizes.iter().copied().max().unwrap_or(0);
        let (n, nf) = (plan.sizes.len(), plan.fragments.len());
        Probe {
            plan,
            steps,
            threshold_steps,
            next_step: 0,
            in_flight: None,
            next_id: 0,
            eager_min: vec![None; n],
            rndv_min: vec![None; n],
            frag_min: vec![None; nf],
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
        let probe_id = self.next_id;
        Some(match *step {
            Step::Threshold {
                size_idx,
                proto: Protocol::Eager,
                ..
            } => Sample::Eager {
                probe_id,
                pad: self.pad.slice(..self.plan.sizes[size_idx]),
            },
            Step::Threshold {
                size_idx,
                proto: Protocol::Rendezvous,
                ..
            } => Sample::Rts {
                probe_id,
                len: self.plan.sizes[size_idx] as u64,
                desc: self.desc.clone(),
            },
            Step::Fragment { frag_idx, .. } => Sample::Read {
                probe_id,
                len: self.plan.fragment_len as u64,
                fragment: u32::try_from(self.plan.fragments[frag_idx]).unwrap_or(u32::MAX),
                desc: self.desc.clone(),
            },
        })
    }

    /// The sample from [`Probe::next_sample`] went out at `now`.
    pub(crate) fn sent(&mut self, now: Instant) {
        if let Some(step) = self.steps.get(self.next_step) {
            self.in_flight = Some((self.next_id, step.proto(), now));
            self.next_id = self.next_id.wrapping_add(1);
        }
    }

    /// The answer to sample `probe_id` (of protocol `proto`) arrived at `now`.
    pub(crate) fn answered(&mut self, now: Instant, probe_id: u32, proto: Protocol) -> Progress {
        match self.in_flight {
            Some((id, p, sent)) if id == probe_id && p == proto => {
                self.in_flight = None;
                if !self.abandoned {
                    let rtt = now.saturating_duration_since(sent);
                    let slot = match self.steps[self.next_step] {
                        Step::Threshold {
                            size_idx,
                            proto,
                            counted,
                        } => {
                            tracing::trace!(
                                probe_id,
                                ?proto,
                                size = self.plan.sizes[size_idx],
                                counted,
                                ?rtt,
                                "probe sample answered"
                            );
                            let mins = if proto == Protocol::Eager {
                                &mut self.eager_min
                            } else {
                                &mut self.rndv_min
                            };
                            counted.then_some(&mut mins[size_idx])
                        }
                        Step::Fragment { frag_idx, counted } => {
                            tracing::trace!(
                                probe_id,
                                fragment = self.plan.fragments[frag_idx],
                                counted,
                                ?rtt,
                                "probe read answered"
                            );
                            counted.then_some(&mut self.frag_min[frag_idx])
                        }
                    };
                    if let Some(slot) = slot {
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
            if matches!(self.in_flight, Some((_, Protocol::Rendezvous, _))) {
                return Progress::Running;
            }
        } else if self.next_step < self.steps.len() {
            return Progress::Running;
        }
        Progress::Finished(self.verdict())
    }

    /// What the samples taken so far support: the threshold once its whole phase ran, the
    /// fragment size once every candidate has a counted sample.
    fn verdict(&self) -> Verdict {
        let threshold = if self.next_step >= self.threshold_steps {
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
            choose_threshold(&costs)
        } else {
            None
        };
        let fragment = if self.frag_min.iter().all(Option::is_some) {
            let costs: Vec<FragmentCost> = self
                .plan
                .fragments
                .iter()
                .zip(&self.frag_min)
                .filter_map(|(&fragment, t)| {
                    Some(FragmentCost {
                        fragment,
                        time: (*t)?,
                    })
                })
                .collect();
            choose_fragment(&costs)
        } else {
            None
        };
        Verdict {
            threshold,
            fragment,
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
            ..ProbePlan::default_for(0)
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
                Sample::Read { .. } => panic!("no fragment phase in this plan"),
            };
            let rtt = if n % 3 == 0 { 1000 } else { rtt };
            n += 1;
            now += Duration::from_micros(rtt);
            last = p.answered(now, id, proto);
        }
        assert_eq!(n, 12);
        assert_eq!(
            last,
            Progress::Finished(Verdict {
                threshold: Some(100),
                fragment: None
            })
        );
    }

    #[test]
    fn abandoning_waits_for_a_rendezvous_sample_in_flight() {
        let t0 = Instant::now();
        let mut p = Probe::new(
            ProbePlan {
                sizes: vec![100],
                reps: 0,
                ..ProbePlan::default_for(0)
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
        assert_eq!(
            p.answered(t0, 1, Protocol::Rendezvous),
            Progress::Finished(Verdict::default())
        );
    }

    #[test]
    fn abandoning_with_an_eager_sample_out_is_immediate() {
        let t0 = Instant::now();
        let mut p = Probe::new(
            ProbePlan {
                sizes: vec![100],
                reps: 1,
                ..ProbePlan::default_for(0)
            },
            Bytes::new(),
            t0,
            PROBE_TIMEOUT,
        );
        assert!(p.next_sample().is_some());
        p.sent(t0);
        assert_eq!(p.abandon(), Progress::Finished(Verdict::default()));
    }

    fn fcost(fragment: usize, us: u64) -> FragmentCost {
        FragmentCost {
            fragment,
            time: Duration::from_micros(us),
        }
    }

    #[test]
    fn fragment_plan_keeps_candidates_a_sample_covers_four_times() {
        let p = ProbePlan::default_for(65518).with_fragments(FRAGMENT_PROBE_LEN);
        assert_eq!(p.fragments, FRAGMENT_CANDIDATES.to_vec());
        assert_eq!((p.fragment_len, p.fragment_reps), (FRAGMENT_PROBE_LEN, 2));
        assert_eq!(
            ProbePlan::default_for(65518)
                .with_fragments(1 << 20)
                .fragments,
            vec![64 << 10, 128 << 10, 256 << 10]
        );
        assert!(ProbePlan::default_for(65518).fragments.is_empty());
    }

    #[test]
    fn the_fastest_fragment_wins() {
        let c = [fcost(65536, 900), fcost(262144, 500), fcost(1 << 20, 400)];
        assert_eq!(choose_fragment(&c), Some(1 << 20));
        let c = [fcost(65536, 300), fcost(262144, 500), fcost(1 << 20, 700)];
        assert_eq!(choose_fragment(&c), Some(65536));
        assert_eq!(choose_fragment(&[]), None);
    }

    #[test]
    fn near_ties_go_to_the_smaller_fragment() {
        // 104 µs is within 5% of 100 µs; 106 µs is not.
        assert_eq!(
            choose_fragment(&[fcost(65536, 104), fcost(131072, 100)]),
            Some(65536)
        );
        assert_eq!(
            choose_fragment(&[fcost(65536, 106), fcost(131072, 100)]),
            Some(131072)
        );
    }

    /// Answers every sample of `p`, a read sample of fragment `f` taking `read(f)` µs and
    /// anything else 10 µs. Returns the samples seen and the last progress.
    fn drive(p: &mut Probe, read: impl Fn(u32) -> u64) -> (Vec<Sample>, Progress) {
        let mut now = Instant::now();
        let mut seen = Vec::new();
        let mut last = Progress::Running;
        while let Some(s) = p.next_sample() {
            p.sent(now);
            let (id, proto, us) = match &s {
                Sample::Eager { probe_id, .. } => (*probe_id, Protocol::Eager, 10),
                Sample::Rts { probe_id, .. } => (*probe_id, Protocol::Rendezvous, 10),
                Sample::Read {
                    probe_id, fragment, ..
                } => (*probe_id, Protocol::Rendezvous, read(*fragment)),
            };
            seen.push(s);
            now += Duration::from_micros(us);
            last = p.answered(now, id, proto);
        }
        (seen, last)
    }

    #[test]
    fn fragment_rounds_follow_the_threshold_phase_and_pick_the_fastest() {
        let plan = ProbePlan {
            sizes: vec![100],
            reps: 1,
            ..ProbePlan::default_for(0)
        }
        .with_fragments(FRAGMENT_PROBE_LEN);
        let mut p = Probe::new(
            plan,
            Bytes::from_static(b"d"),
            Instant::now(),
            PROBE_TIMEOUT,
        );
        // Reads get faster up to 256 KiB, then slower again.
        let (seen, last) = drive(&mut p, |f| match f {
            f if f == 256 << 10 => 2_000,
            f if f < 256 << 10 => 3_000,
            _ => 2_500,
        });
        assert_eq!(
            last,
            Progress::Finished(Verdict {
                threshold: Some(100),
                fragment: Some(256 << 10)
            })
        );
        let reads: Vec<(u64, u32)> = seen
            .iter()
            .filter_map(|s| match s {
                Sample::Read { len, fragment, .. } => Some((*len, *fragment)),
                _ => None,
            })
            .collect();
        // 4 threshold samples, then a warm-up at the largest and two interleaved rounds.
        assert_eq!(seen.len(), 4 + 1 + 2 * 5);
        assert!(seen[..4].iter().all(|s| !matches!(s, Sample::Read { .. })));
        let frags: Vec<u32> = reads.iter().map(|r| r.1 >> 10).collect();
        assert_eq!(
            frags,
            vec![1024, 64, 128, 256, 512, 1024, 64, 128, 256, 512, 1024]
        );
        assert!(reads.iter().all(|r| r.0 == FRAGMENT_PROBE_LEN as u64));
    }

    #[test]
    fn abandoning_in_the_fragment_phase_keeps_the_threshold() {
        let plan = ProbePlan {
            sizes: vec![100],
            reps: 1,
            ..ProbePlan::default_for(0)
        }
        .with_fragments(FRAGMENT_PROBE_LEN);
        let t0 = Instant::now();
        let mut p = Probe::new(plan, Bytes::new(), t0, PROBE_TIMEOUT);
        for (id, proto) in [
            (0, Protocol::Eager),
            (1, Protocol::Eager),
            (2, Protocol::Rendezvous),
            (3, Protocol::Rendezvous),
        ] {
            assert!(p.next_sample().is_some());
            p.sent(t0);
            assert_eq!(
                p.answered(t0 + Duration::from_micros(5), id, proto),
                Progress::Running
            );
        }
        assert!(matches!(
            p.next_sample(),
            Some(Sample::Read { probe_id: 4, .. })
        ));
        p.sent(t0);
        assert_eq!(
            p.abandon(),
            Progress::Running,
            "the peer may be reading the buffer"
        );
        let v = Verdict {
            threshold: Some(100),
            fragment: None,
        };
        assert_eq!(
            p.answered(t0, 4, Protocol::Rendezvous),
            Progress::Finished(v)
        );
    }

    #[test]
    fn one_full_round_is_enough_for_a_fragment_verdict() {
        let plan = ProbePlan {
            sizes: vec![],
            ..ProbePlan::default_for(0)
        }
        .with_fragments(FRAGMENT_PROBE_LEN);
        let t0 = Instant::now();
        let mut p = Probe::new(plan, Bytes::new(), t0, PROBE_TIMEOUT);
        let mut now = t0;
        // Warm-up and one round: 64 KiB is the fastest.
        for id in 0..6u32 {
            let Some(Sample::Read { fragment, .. }) = p.next_sample() else {
                panic!("read sample")
            };
            p.sent(now);
            now += Duration::from_micros(if fragment == 64 << 10 { 100 } else { 500 });
            assert_eq!(p.answered(now, id, Protocol::Rendezvous), Progress::Running);
        }
        assert_eq!(
            p.abandon(),
            Progress::Finished(Verdict {
                threshold: None,
                fragment: Some(64 << 10)
            })
        );
    }
}

//! Model-based property test of the outbox: random sequences of append,
//! claim, complete, release, expire, clock steps and reopenings run against
//! a deliberately simple model (a sorted `Vec` per partition) and a backend;
//! every answer and, after every step, every stored record and the number of
//! envelopes kept (one per message with a record left) must agree.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use proptest::prelude::*;

use super::{OutboxHarness, STALE, envelope, t};
use crate::stores::{Claim, NewMessage, NewRecord, OutboxRecord, OutboxStore, Release, StoreError};

const PARTITIONS: [&str; 2] = ["p0", "p1"];

#[derive(Clone, Debug)]
enum Op {
    /// One message for `bindings`, expiring after `ttl` seconds; `poison`
    /// adds a record with no binding.
    Append {
        p: usize,
        bindings: Vec<u8>,
        ttl: Option<u8>,
        poison: bool,
    },
    Claim {
        p: usize,
        owner: u8,
        version: Version,
        limit: usize,
    },
    Complete {
        p: usize,
        version: Version,
        picks: Vec<Pick>,
    },
    Release {
        p: usize,
        version: Version,
        picks: Vec<Pick>,
        failed: bool,
    },
    Expire {
        p: usize,
        owner: u8,
        version: Version,
        limit: usize,
    },
    Advance {
        secs: u64,
    },
    Reopen,
}

/// A version relative to the partition's mark when the step runs, so that
/// most steps act (a random number would mostly be fenced out).
#[derive(Clone, Copy, Debug)]
enum Version {
    Current,
    Next,
    Below,
}

impl Version {
    fn resolve(self, hwm: u64) -> u64 {
        match self {
            Version::Current => hwm,
            Version::Next => hwm + 1,
            Version::Below => hwm.saturating_sub(1),
        }
    }
}

/// A seq: one of the partition's claimed records or of all its records when
/// the step runs (by index), or any number (mostly absent).
#[derive(Clone, Copy, Debug)]
enum Pick {
    Claimed(usize),
    Record(usize),
    Raw(u64),
}

impl Pick {
    fn resolve(self, records: &[OutboxRecord]) -> u64 {
        let claimed: Vec<&OutboxRecord> = records.iter().filter(|r| r.claim.is_some()).collect();
        match self {
            Pick::Claimed(i) if !claimed.is_empty() => claimed[i % claimed.len()].seq,
            Pick::Claimed(i) => i as u64,
            Pick::Record(i) if !records.is_empty() => records[i % records.len()].seq,
            Pick::Record(i) => i as u64,
            Pick::Raw(s) => s,
        }
    }
}

fn op() -> impl Strategy<Value = Op> {
    let p = 0..PARTITIONS.len();
    let version = prop_oneof![
        8 => Just(Version::Current),
        1 => Just(Version::Next),
        1 => Just(Version::Below),
    ];
    let pick = prop_oneof![
        5 => (0usize..16).prop_map(Pick::Claimed),
        2 => (0usize..16).prop_map(Pick::Record),
        1 => (0u64..30).prop_map(Pick::Raw),
    ];
    let seqs = proptest::collection::vec(pick, 0..5);
    prop_oneof![
        3 => (p.clone(), proptest::collection::vec(0u8..3, 1..4), proptest::option::of(0u8..60), proptest::bool::weighted(0.1))
            .prop_map(|(p, bindings, ttl, poison)| Op::Append { p, bindings, ttl, poison }),
        3 => (p.clone(), 0u8..2, version.clone(), 0usize..5)
            .prop_map(|(p, owner, version, limit)| Op::Claim { p, owner, version, limit }),
        2 => (p.clone(), version.clone(), seqs.clone())
            .prop_map(|(p, version, picks)| Op::Complete { p, version, picks }),
        2 => (p.clone(), version.clone(), seqs, any::<bool>())
            .prop_map(|(p, version, picks, failed)| Op::Release { p, version, picks, failed }),
        1 => (p, 0u8..2, version, 0usize..4)
            .prop_map(|(p, owner, version, limit)| Op::Expire { p, owner, version, limit }),
        2 => (0u64..40).prop_map(|secs| Op::Advance { secs }),
        1 => Just(Op::Reopen),
    ]
}

/// What an operation answered, with errors reduced to their kind.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    Seqs(Vec<u64>),
    Error(&'static str),
    None,
}

fn answer(r: Result<Vec<u64>, StoreError>) -> Answer {
    match r {
        Ok(s) => Answer::Seqs(s),
        Err(StoreError::Stale(_)) => Answer::Error("stale"),
        Err(StoreError::Invalid(_)) => Answer::Error("invalid"),
        Err(e) => panic!("unexpected store error {e}"),
    }
}

fn seqs_of(r: Result<Vec<OutboxRecord>, StoreError>) -> Result<Vec<u64>, StoreError> {
    r.map(|v| v.iter().map(|r| r.seq).collect())
}

#[derive(Default)]
struct Partition {
    hwm: u64,
    last_seq: u64,
    records: Vec<OutboxRecord>,
}

impl Partition {
    /// Messages with a record left: each envelope has a fresh id.
    fn messages(&self) -> usize {
        let mut ids: Vec<&str> = self
            .records
            .iter()
            .map(|r| r.envelope.id.as_str())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }
}

/// The model: each rule of the contract written the plainest way.
#[derive(Default)]
struct Model {
    partitions: [Partition; 2],
}

impl Model {
    fn resolve(&self, p: usize, version: Version, picks: &[Pick]) -> (u64, Vec<u64>) {
        let part = &self.partitions[p];
        let seqs = picks.iter().map(|x| x.resolve(&part.records)).collect();
        (version.resolve(part.hwm), seqs)
    }

    fn append(&mut self, p: usize, message: &NewMessage) -> Answer {
        if message.records.iter().any(|r| r.binding.is_empty()) {
            return Answer::Error("invalid");
        }
        let part = &mut self.partitions[p];
        let envelope = Arc::new(message.envelope.clone());
        let mut seqs = Vec::new();
        for r in &message.records {
            part.last_seq += 1;
            seqs.push(part.last_seq);
            part.records.push(OutboxRecord {
                partition: PARTITIONS[p].into(),
                seq: part.last_seq,
                id: r.id.clone(),
                binding: Arc::clone(&r.binding),
                address: Arc::clone(&r.address),
                envelope: Arc::clone(&envelope),
                created_at: message.created_at,
                expires_at: message.expires_at,
                claim: None,
                replay_count: 0,
                first_attempt_at: None,
                last_error: None,
            });
        }
        Answer::Seqs(seqs)
    }

    fn claim(
        &mut self,
        p: usize,
        owner: &str,
        version: u64,
        limit: usize,
        now: SystemTime,
    ) -> Answer {
        let part = &mut self.partitions[p];
        if version < part.hwm {
            return Answer::Error("stale");
        }
        if version > part.hwm {
            part.hwm = version;
            for r in &mut part.records {
                r.claim = None; // every claim is at the old mark
            }
        }
        let mut out = Vec::new();
        for r in &mut part.records {
            let eligible = match &r.claim {
                None => true,
                Some(c) => c.owner == owner && c.claimed_at + STALE <= now,
            };
            if eligible && out.len() < limit {
                r.claim = Some(Claim {
                    version,
                    owner: owner.into(),
                    claimed_at: now,
                });
                out.push(r.seq);
            }
        }
        Answer::Seqs(out)
    }

    fn settle(&mut self, p: usize, version: u64, seqs: &[u64], how: Option<&Release>) -> Answer {
        let part = &mut self.partitions[p];
        if version < part.hwm {
            return Answer::Error("stale");
        }
        let hit = |r: &OutboxRecord| {
            seqs.contains(&r.seq) && r.claim.as_ref().is_some_and(|c| c.version == version)
        };
        let done: Vec<u64> = part
            .records
            .iter()
            .filter(|r| hit(r))
            .map(|r| r.seq)
            .collect();
        match how {
            None => part.records.retain(|r| !done.contains(&r.seq)),
            Some(how) => {
                for r in part.records.iter_mut().filter(|r| done.contains(&r.seq)) {
                    r.claim = None;
                    if let Release::Failed {
                        error,
                        attempted_at,
                    } = how
                    {
                        r.replay_count += 1;
                        r.first_attempt_at = r.first_attempt_at.or(Some(*attempted_at));
                        r.last_error = Some(error.clone());
                    }
                }
            }
        }
        Answer::Seqs(done)
    }

    fn expire(
        &mut self,
        p: usize,
        owner: &str,
        version: u64,
        now: SystemTime,
        limit: usize,
    ) -> Answer {
        let part = &mut self.partitions[p];
        if version < part.hwm {
            return Answer::Error("stale");
        }
        if version > part.hwm {
            part.hwm = version;
            for r in &mut part.records {
                r.claim = None;
            }
        }
        let mut out = Vec::new();
        for r in &mut part.records {
            if r.claim.is_none() && r.expires_at.is_some_and(|e| e <= now) && out.len() < limit {
                r.claim = Some(Claim {
                    version,
                    owner: owner.into(),
                    claimed_at: now,
                });
                out.push(r.seq);
            }
        }
        Answer::Seqs(out)
    }
}

async fn check<S: OutboxHarness + OutboxStore>(
    mut store: S,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let mut model = Model::default();
    let mut now = t(0);
    for (step, op) in ops.into_iter().enumerate() {
        let (want, got) = match &op {
            Op::Append {
                p,
                bindings,
                ttl,
                poison,
            } => {
                let mut records: Vec<NewRecord> = bindings
                    .iter()
                    .map(|b| NewRecord::new(format!("b{b}"), "addr"))
                    .collect();
                if *poison {
                    records.insert(records.len() / 2, NewRecord::new("", "addr"));
                }
                let message = NewMessage {
                    expires_at: ttl.map(|s| now + Duration::from_secs(s.into())),
                    ..NewMessage::new(envelope("m"), now, records)
                };
                (
                    model.append(*p, &message),
                    answer(store.append(PARTITIONS[*p], message).await),
                )
            }
            Op::Claim {
                p,
                owner,
                version,
                limit,
            } => {
                let owner = format!("o{owner}");
                let version = &version.resolve(model.partitions[*p].hwm);
                (
                    model.claim(*p, &owner, *version, *limit, now),
                    answer(seqs_of(
                        store
                            .claim(PARTITIONS[*p], &owner, *version, *limit, now)
                            .await,
                    )),
                )
            }
            Op::Complete { p, version, picks } => {
                let (version, seqs) = model.resolve(*p, *version, picks);
                (
                    model.settle(*p, version, &seqs, None),
                    answer(store.complete(PARTITIONS[*p], version, &seqs).await),
                )
            }
            Op::Release {
                p,
                version,
                picks,
                failed,
            } => {
                let (version, seqs) = model.resolve(*p, *version, picks);
                let (version, seqs) = (&version, &seqs);
                let how = if *failed {
                    Release::Failed {
                        error: format!("e{step}"),
                        attempted_at: now,
                    }
                } else {
                    Release::Untried
                };
                (
                    model.settle(*p, *version, seqs, Some(&how)),
                    answer(store.release(PARTITIONS[*p], *version, seqs, how).await),
                )
            }
            Op::Expire {
                p,
                owner,
                version,
                limit,
            } => {
                let owner = format!("o{owner}");
                let version = version.resolve(model.partitions[*p].hwm);
                (
                    model.expire(*p, &owner, version, now, *limit),
                    answer(seqs_of(
                        store
                            .expire(PARTITIONS[*p], &owner, version, now, *limit)
                            .await,
                    )),
                )
            }
            Op::Advance { secs } => {
                now += Duration::from_secs(*secs);
                (Answer::None, Answer::None)
            }
            Op::Reopen => {
                store = store.reopen().await;
                (Answer::None, Answer::None)
            }
        };
        prop_assert_eq!(want, got, "step {}: {:?}", step, op);
        for (i, p) in PARTITIONS.iter().enumerate() {
            let stored = store
                .dump(p)
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(
                &model.partitions[i].records,
                &stored,
                "step {}: {:?}",
                step,
                op
            );
            let envelopes = store
                .envelopes(p)
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(
                model.partitions[i].messages(),
                envelopes,
                "envelopes kept after step {}: {:?}",
                step,
                op
            );
            let stats = store
                .stats(p)
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(stats.total.depth, stored.len() as u64);
            let claimed = stored.iter().filter(|r| r.claim.is_some()).count() as u64;
            prop_assert_eq!(stats.total.claimed, claimed, "claimed after step {}", step);
            let oldest_pending = stored
                .iter()
                .filter(|r| r.claim.is_none())
                .map(|r| r.created_at)
                .min();
            prop_assert_eq!(
                stats.total.oldest_pending_created_at,
                oldest_pending,
                "oldest pending after step {}",
                step
            );
            prop_assert_eq!(stats.high_water_mark, model.partitions[i].hwm);
            let broken = store
                .broken_invariants(p)
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(
                broken.is_empty(),
                "after step {}: {:?}: {:?}",
                step,
                op,
                broken
            );
        }
    }
    Ok(())
}

fn run<S, F, Fut>(make: F, ops: Vec<Op>) -> Result<(), TestCaseError>
where
    S: OutboxHarness + OutboxStore,
    F: FnOnce() -> Fut,
    Fut: Future<Output = (S, super::Guard)>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    rt.block_on(async {
        let (store, _guard) = make().await;
        check(store, ops).await
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn memory_outbox_agrees_with_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        run(super::memory_outbox, ops)?;
    }

    #[test]
    fn sqlite_outbox_agrees_with_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        run(super::sqlite_outbox_normal, ops)?;
    }
}

proptest! {
    // A fresh database per case: fewer cases keep the suite fast.
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn postgres_outbox_agrees_with_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        run(super::postgres_outbox, ops)?;
    }
}

proptest! {
    // A fresh table per case on moto, where every call is an HTTP round trip
    // and every step is checked with a dump of each partition (about 6 s a
    // case): fewer cases keep the suite fast.
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    #[test]
    fn dynamodb_outbox_agrees_with_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        run(super::dynamodb_outbox, ops)?;
    }
}

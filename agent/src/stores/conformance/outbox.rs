//! The `OutboxStore` conformance suite (DESIGN §5.1).

use std::sync::Arc;
use std::time::Duration;

use super::{OutboxHarness, STALE, envelope, t, unique};
use crate::stores::{NewMessage, NewRecord, OutboxRecord, OutboxStore, Release, StoreError};

/// Instantiates every test of this suite for a backend.
macro_rules! outbox_conformance {
    ($backend:ident, $make:ident) => {
        $crate::__store_conformance!(
            outbox, $backend, $make;
            append_assigns_increasing_seqs_never_reused,
            append_is_all_or_nothing,
            acknowledged_appends_are_visible_and_durable,
            claim_is_oldest_first_per_binding,
            claim_below_hwm_is_stale_and_changes_nothing,
            claim_above_hwm_takes_back_older_claims,
            complete_deletes_only_records_claimed_with_its_version,
            release_counted_and_uncounted,
            stale_own_claim_comes_back,
            stale_claims_are_found_among_fresh_foreign_and_pending_ones,
            a_stale_expiry_comes_back_wherever_it_lies,
            expire_claims_only_pending_past_expiry,
            stats_match_records,
            partitions_are_independent,
            a_message_is_stored_once_until_its_last_record_completes,
        );
    };
}
pub(crate) use outbox_conformance;

/// A message named `name` for `bindings`, each sending to `{binding}/topic`.
fn msg(name: &str, bindings: &[&str]) -> NewMessage {
    let records = bindings
        .iter()
        .map(|b| NewRecord::new(*b, format!("{b}/topic")))
        .collect();
    NewMessage::new(envelope(name), t(0), records)
}

fn seqs(records: &[OutboxRecord]) -> Vec<u64> {
    records.iter().map(|r| r.seq).collect()
}

fn assert_stale<T: std::fmt::Debug>(r: Result<T, StoreError>) {
    assert!(
        matches!(r, Err(StoreError::Stale(_))),
        "expected Stale, got {r:?}"
    );
}

/// Appends one message for `bindings`, named after them (`"a,b"`).
async fn append_n<S: OutboxStore>(s: &S, p: &str, bindings: &[&str]) -> Vec<u64> {
    s.append(p, msg(&bindings.join(","), bindings))
        .await
        .expect("append")
}

pub(crate) async fn append_assigns_increasing_seqs_never_reused<S: OutboxHarness + OutboxStore>(
    s: S,
) {
    let p = unique("p");
    let first = append_n(&s, &p, &["a", "b", "c"]).await;
    let second = append_n(&s, &p, &["a"]).await;
    assert_eq!(first.len(), 3);
    let all: Vec<u64> = first.iter().chain(&second).copied().collect();
    assert!(all.windows(2).all(|w| w[0] < w[1]), "{all:?}");
    // Deleting every record, even across a reopen, never lets a seq repeat.
    let claimed = s.claim(&p, "o", 1, 10, t(1)).await.expect("claim");
    s.complete(&p, 1, &seqs(&claimed)).await.expect("complete");
    let s = s.reopen().await;
    let third = append_n(&s, &p, &["b"]).await;
    assert!(
        third[0] > all[3],
        "seq {} reused after {}",
        third[0],
        all[3]
    );
    assert_eq!(s.append(&p, msg("nowhere", &[])).await, Ok(vec![]));
    assert_eq!(
        s.envelopes(&p).await,
        Ok(1),
        "a message without records is not stored"
    );
}

pub(crate) async fn append_is_all_or_nothing<S: OutboxHarness + OutboxStore>(s: S) {
    let p = unique("p");
    append_n(&s, &p, &["a"]).await;
    let r = s.append(&p, msg("no binding", &["a", "", "b"])).await;
    assert!(matches!(r, Err(StoreError::Invalid(_))), "{r:?}");
    assert!(r.as_ref().err().is_some_and(StoreError::outcome_known));
    let mut no_id = msg("no id", &["a"]);
    no_id.records[0].id.clear();
    assert!(matches!(
        s.append(&p, no_id).await,
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        s.append("", msg("x", &["a"])).await,
        Err(StoreError::Invalid(_))
    ));
    let s = s.reopen().await;
    let left = s.dump(&p).await.expect("dump");
    assert_eq!(left.len(), 1, "a refused message left records: {left:?}");
    assert_eq!(s.stats(&p).await.expect("stats").total.depth, 1);
    assert_eq!(s.envelopes(&p).await, Ok(1));
}

pub(crate) async fn acknowledged_appends_are_visible_and_durable<S: OutboxHarness + OutboxStore>(
    s: S,
) {
    // Concurrent writers and a claimer: group commit puts several callers in
    // one transaction; every acknowledged record must be claimable once,
    // exactly as appended, and survive a reopen.
    let p = unique("p");
    let s = Arc::new(s);
    let mut writers = Vec::new();
    for w in 0..8 {
        let (s, p) = (Arc::clone(&s), p.clone());
        writers.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            for i in 0..10 {
                let (x, y) = (format!("b{w}x"), format!("b{w}y"));
                let m = msg(&format!("{w}-{i}"), &[&x, &y]);
                let seqs = s.append(&p, m.clone()).await.expect("append");
                for (seq, r) in seqs.into_iter().zip(m.records) {
                    acked.push((seq, r.id, m.envelope.clone()));
                }
            }
            acked
        }));
    }
    let claimer = {
        let (s, p) = (Arc::clone(&s), p.clone());
        tokio::spawn(async move {
            let mut got = Vec::new();
            for _ in 0..20 {
                got.extend(s.claim(&p, "o", 1, 7, t(1)).await.expect("claim"));
                tokio::task::yield_now().await;
            }
            got
        })
    };
    let mut acked = Vec::new();
    for w in writers {
        acked.extend(w.await.expect("writer"));
    }
    let claimed = claimer.await.expect("claimer");
    let s = Arc::into_inner(s).expect("sole owner").reopen().await;
    let stored = s.dump(&p).await.expect("dump");
    assert_eq!(stored.len(), 160);
    assert_eq!(s.envelopes(&p).await, Ok(80));
    acked.sort_by_key(|(seq, _, _)| *seq);
    for ((seq, id, envelope), r) in acked.iter().zip(&stored) {
        assert_eq!((*seq, id, envelope), (r.seq, &r.id, &*r.envelope));
    }
    let mut claimed_seqs = seqs(&claimed);
    claimed_seqs.sort_unstable();
    claimed_seqs.dedup();
    assert_eq!(
        claimed_seqs.len(),
        claimed.len(),
        "a record was claimed twice"
    );
}

pub(crate) async fn claim_is_oldest_first_per_binding<S: OutboxHarness + OutboxStore>(s: S) {
    let p = unique("p");
    let mut appended = append_n(&s, &p, &["a", "b", "c"]).await;
    appended.extend(append_n(&s, &p, &["c", "a", "b"]).await);
    appended.extend(append_n(&s, &p, &["b"]).await);
    let s = s.reopen().await;
    let first = s.claim(&p, "o", 1, 4, t(1)).await.expect("claim");
    let second = s.claim(&p, "o", 1, 10, t(1)).await.expect("claim");
    assert_eq!(seqs(&first), appended[..4]);
    assert_eq!(seqs(&second), appended[4..]);
    let all: Vec<OutboxRecord> = first.into_iter().chain(second).collect();
    for b in ["a", "b", "c"] {
        let order: Vec<u64> = all
            .iter()
            .filter(|r| *r.binding == *b)
            .map(|r| r.seq)
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{b}: {order:?}");
    }
    let r = &all[0];
    assert_eq!((&*r.binding, &*r.address), ("a", "a/topic"));
    assert_eq!(r.envelope.payload.as_ref(), b"a,b,c");
    // The records of a message returned by one call share its envelope.
    assert!(
        all[..3]
            .iter()
            .all(|x| Arc::ptr_eq(&x.envelope, &r.envelope))
    );
    assert_eq!(all[3].envelope.payload.as_ref(), b"c,a,b");
    let claim = r.claim.as_ref().expect("claimed");
    assert_eq!(
        (claim.version, claim.owner.as_str(), claim.claimed_at),
        (1, "o", t(1))
    );
    assert!(
        s.claim(&p, "o", 1, 10, t(2))
            .await
            .expect("claim")
            .is_empty()
    );
    assert!(
        s.claim(&p, "o", 1, 0, t(2))
            .await
            .expect("claim")
            .is_empty()
    );
}

pub(crate) async fn claim_below_hwm_is_stale_and_changes_nothing<S: OutboxHarness + OutboxStore>(
    s: S,
) {
    let p = unique("p");
    append_n(&s, &p, &["a", "a", "b"]).await;
    let got = s.claim(&p, "new", 5, 2, t(1)).await.expect("claim");
    let s = s.reopen().await;
    let before = s.dump(&p).await.expect("dump");
    assert_stale(s.claim(&p, "old", 4, 10, t(2)).await);
    assert_stale(s.complete(&p, 4, &seqs(&got)).await);
    assert_stale(s.release(&p, 4, &seqs(&got), Release::Untried).await);
    let s = s.reopen().await;
    assert_eq!(s.dump(&p).await.expect("dump"), before);
    assert_eq!(s.stats(&p).await.expect("stats").high_water_mark, 5);
    let err = s.claim(&p, "old", 4, 10, t(2)).await.err();
    assert!(err.is_some_and(|e| e.outcome_known()));
}

pub(crate) async fn claim_above_hwm_takes_back_older_claims<S: OutboxHarness + OutboxStore>(s: S) {
    let p = unique("p");
    let appended = append_n(&s, &p, &["a", "b", "a", "b", "a"]).await;
    let old = s.claim(&p, "A", 1, 3, t(1)).await.expect("claim");
    assert_eq!(seqs(&old), appended[..3]);
    let s = s.reopen().await;
    // A newer lease gets every record at once, in order, with no wait.
    let new = s.claim(&p, "B", 2, 10, t(2)).await.expect("claim");
    assert_eq!(seqs(&new), appended);
    assert!(new.iter().all(|r| r.replay_count == 0));
    assert!(
        new.iter()
            .all(|r| r.claim.as_ref().is_some_and(|c| c.version == 2))
    );
    // The old holder's late outcomes are fenced out.
    assert_stale(s.complete(&p, 1, &seqs(&old)).await);
    assert_stale(s.release(&p, 1, &seqs(&old), Release::Untried).await);
    assert_eq!(s.dump(&p).await.expect("dump").len(), 5);
}

pub(crate) async fn complete_deletes_only_records_claimed_with_its_version<
    S: OutboxHarness + OutboxStore,
>(
    s: S,
) {
    let p = unique("p");
    let appended = append_n(&s, &p, &["a", "a", "a"]).await;
    let got = s.claim(&p, "o", 3, 2, t(1)).await.expect("claim");
    // Unknown and unclaimed seqs are ignored; duplicates count once.
    let mut asked = seqs(&got);
    asked.extend([appended[2], 999, got[0].seq]);
    assert_eq!(s.complete(&p, 3, &asked).await, Ok(seqs(&got)));
    // A version above the mark has claimed nothing.
    let rest = s.claim(&p, "o", 3, 10, t(1)).await.expect("claim");
    assert_eq!(s.complete(&p, 4, &seqs(&rest)).await, Ok(vec![]));
    assert_eq!(s.complete(&unique("none"), 1, &[1]).await, Ok(vec![]));
    let s = s.reopen().await;
    assert_eq!(seqs(&s.dump(&p).await.expect("dump")), vec![appended[2]]);
    assert_eq!(s.complete(&p, 3, &seqs(&rest)).await, Ok(seqs(&rest)));
    let s = s.reopen().await;
    assert!(s.dump(&p).await.expect("dump").is_empty());
}

pub(crate) async fn release_counted_and_uncounted<S: OutboxHarness + OutboxStore>(s: S) {
    let p = unique("p");
    let seq = append_n(&s, &p, &["a"]).await[0];
    let failed = |error: &str, at| Release::Failed {
        error: error.into(),
        attempted_at: at,
    };
    s.claim(&p, "o", 1, 1, t(1)).await.expect("claim");
    assert_eq!(
        s.release(&p, 1, &[seq], failed("e1", t(2))).await,
        Ok(vec![seq])
    );
    let s = s.reopen().await;
    let r = &s.claim(&p, "o", 1, 1, t(3)).await.expect("claim")[0];
    assert_eq!((r.replay_count, r.first_attempt_at), (1, Some(t(2))));
    assert_eq!(r.last_error.as_deref(), Some("e1"));
    s.release(&p, 1, &[seq], failed("e2", t(4)))
        .await
        .expect("release");
    s.claim(&p, "o", 1, 1, t(5)).await.expect("claim");
    s.release(&p, 1, &[seq], Release::Untried)
        .await
        .expect("release");
    let s = s.reopen().await;
    let r = &s.dump(&p).await.expect("dump")[0];
    assert!(r.claim.is_none(), "released record is pending");
    assert_eq!((r.replay_count, r.first_attempt_at), (2, Some(t(2))));
    assert_eq!(r.last_error.as_deref(), Some("e2"));
    // Releasing a pending record does nothing.
    assert_eq!(
        s.release(&p, 1, &[seq], failed("e3", t(6))).await,
        Ok(vec![])
    );
    assert_eq!(s.dump(&p).await.expect("dump")[0].replay_count, 2);
}

pub(crate) async fn stale_own_claim_comes_back<S: OutboxHarness + OutboxStore>(s: S) {
    let p = unique("p");
    let appended = append_n(&s, &p, &["a", "b"]).await;
    s.claim(&p, "A", 1, 10, t(10)).await.expect("claim");
    let s = s.reopen().await;
    let just_before = t(10) + STALE - Duration::from_nanos(1);
    assert!(
        s.claim(&p, "A", 1, 10, just_before)
            .await
            .expect("claim")
            .is_empty()
    );
    // Another owner at the same version never takes someone else's claim.
    assert!(
        s.claim(&p, "B", 1, 10, t(100))
            .await
            .expect("claim")
            .is_empty()
    );
    let back = s.claim(&p, "A", 1, 10, t(10) + STALE).await.expect("claim");
    assert_eq!(seqs(&back), appended);
    let c = back[0].claim.as_ref().expect("claimed");
    assert_eq!(c.claimed_at, t(10) + STALE);
    assert!(back.iter().all(|r| r.replay_count == 0));
}

/// A claim takes back exactly this owner's stale claims, wherever they lie
/// among fresh claims, another owner's claims and released records.
pub(crate) async fn stale_claims_are_found_among_fresh_foreign_and_pending_ones<
    S: OutboxHarness + OutboxStore,
>(
    s: S,
) {
    let p = unique("p");
    let mut appended = Vec::new();
    for _ in 0..6 {
        appended.extend(append_n(&s, &p, &["a"]).await);
    }
    let claim = |owner: &'static str, limit, at| {
        let (s, p) = (&s, &p);
        async move { seqs(&s.claim(p, owner, 1, limit, at).await.expect("claim")) }
    };
    assert_eq!(claim("A", 2, t(10)).await, appended[0..2]);
    assert_eq!(claim("B", 1, t(10)).await, appended[2..3]);
    assert_eq!(claim("A", 2, t(20)).await, appended[3..5]);
    let released = s
        .release(&p, 1, &appended[3..4], Release::Untried)
        .await
        .expect("release");
    assert_eq!(released, appended[3..4]);
    // A's first two are stale, the fourth and sixth pending; B's claim and
    // A's fresh one stay where they are.
    let back = claim("A", 10, t(10) + STALE).await;
    let expected: Vec<u64> = [0, 1, 3, 5].iter().map(|&i| appended[i]).collect();
    assert_eq!(back, expected);
}

/// A record an expiry claimed far ahead of the claimed ones comes back to
/// its owner once stale, with the stale claims below it, and again after a
/// claim took it back.
pub(crate) async fn a_stale_expiry_comes_back_wherever_it_lies<S: OutboxHarness + OutboxStore>(
    s: S,
) {
    let p = unique("p");
    let mut appended = Vec::new();
    for _ in 0..4 {
        appended.extend(append_n(&s, &p, &["a"]).await);
    }
    let expiring = NewMessage {
        expires_at: Some(t(5)),
        ..msg("e", &["e"])
    };
    appended.extend(s.append(&p, expiring).await.expect("append"));
    let claim = |limit, at| {
        let (s, p) = (&s, &p);
        async move { seqs(&s.claim(p, "A", 1, limit, at).await.expect("claim")) }
    };
    assert_eq!(claim(2, t(1)).await, appended[0..2]);
    let expired = s.expire(&p, "A", 1, t(10), 10).await.expect("expire");
    assert_eq!(seqs(&expired), appended[4..5]);
    assert_eq!(claim(2, t(11)).await, appended[2..4]);
    let s = s.reopen().await;
    let claim = |limit, at| {
        let (s, p) = (&s, &p);
        async move { seqs(&s.claim(p, "A", 1, limit, at).await.expect("claim")) }
    };
    // Stale: the first two (claimed at 1) and the expiry (at 10), not the
    // two claimed at 11.
    let back = claim(10, t(10) + STALE).await;
    assert_eq!(back, [appended[0], appended[1], appended[4]]);
    // Taken back by a claim, the expiry goes stale again like the rest.
    let all = claim(10, t(11) + STALE + STALE).await;
    assert_eq!(all, appended);
    let done = s.complete(&p, 1, &appended).await.expect("complete");
    assert_eq!(done, appended);
    assert!(s.dump(&p).await.expect("dump").is_empty());
}

pub(crate) async fn expire_claims_only_pending_past_expiry<S: OutboxHarness + OutboxStore>(s: S) {
    let p = unique("p");
    let expiring = |b: &str, at| NewMessage {
        expires_at: at,
        ..msg(b, &[b])
    };
    let mut seqs_in = Vec::new();
    for m in [
        expiring("claimed", Some(t(10))),
        expiring("due1", Some(t(10))),
        expiring("due2", Some(t(5))),
        expiring("later", Some(t(20))),
        expiring("never", None),
    ] {
        seqs_in.extend(s.append(&p, m).await.expect("append"));
    }
    s.claim(&p, "o", 1, 1, t(1)).await.expect("claim");
    assert!(
        s.expire(&p, "o", 1, t(4), 10)
            .await
            .expect("expire")
            .is_empty()
    );
    let s = s.reopen().await;
    let first = s.expire(&p, "o", 1, t(10), 1).await.expect("expire");
    assert_eq!(seqs(&first), vec![seqs_in[1]]);
    assert_eq!(&*first[0].binding, "due1");
    assert_eq!(first[0].claim.as_ref().map(|c| c.version), Some(1));
    let second = s.expire(&p, "o", 1, t(10), 10).await.expect("expire");
    assert_eq!(seqs(&second), vec![seqs_in[2]]);
    // Expired records are claimed, not gone: a crash before the DLQ write
    // loses nothing, and a newer version takes them back.
    let s = s.reopen().await;
    assert_eq!(s.dump(&p).await.expect("dump").len(), 5);
    assert!(matches!(
        s.expire(&p, "o", 0, t(10), 10).await,
        Err(StoreError::Stale(_))
    ));
    // Version 2 takes back every claim of version 1, the first record's too,
    // which is due as well.
    let again = s.expire(&p, "o", 2, t(10), 10).await.expect("expire");
    assert_eq!(seqs(&again), seqs_in[..3].to_vec());
    let done = s.complete(&p, 2, &seqs(&again)).await.expect("complete");
    assert_eq!(done, seqs(&again));
    let s = s.reopen().await;
    let left: Vec<String> = s
        .dump(&p)
        .await
        .expect("dump")
        .into_iter()
        .map(|r| r.binding.to_string())
        .collect();
    assert_eq!(left, ["later", "never"]);
    assert!(
        s.expire(&unique("none"), "o", 1, t(99), 10)
            .await
            .expect("expire")
            .is_empty()
    );
}

pub(crate) async fn stats_match_records<S: OutboxHarness + OutboxStore>(s: S) {
    let p = unique("p");
    let empty = s.stats(&p).await.expect("stats");
    assert_eq!((empty.total.depth, empty.high_water_mark), (0, 0));
    let at = |b: &str, secs| NewMessage {
        created_at: t(secs),
        ..msg(b, &[b])
    };
    for m in [at("a", 5), at("b", 3), at("a", 7), at("b", 1)] {
        s.append(&p, m).await.expect("append");
    }
    s.claim(&p, "o", 2, 2, t(10)).await.expect("claim"); // a@5, b@3
    let s = s.reopen().await;
    let st = s.stats(&p).await.expect("stats");
    assert_eq!(st.high_water_mark, 2);
    assert_eq!(
        (st.total.depth, st.total.claimed, st.total.pending()),
        (4, 2, 2)
    );
    assert_eq!(st.total.oldest_pending_created_at, Some(t(1)));
    assert_eq!(
        st.total.oldest_pending_age(t(11)),
        Some(Duration::from_secs(10))
    );
    let a = &st.bindings["a"];
    assert_eq!(
        (a.depth, a.claimed, a.oldest_pending_created_at),
        (2, 1, Some(t(7)))
    );
    let b = &st.bindings["b"];
    assert_eq!(
        (b.depth, b.claimed, b.oldest_pending_created_at),
        (2, 1, Some(t(1)))
    );
    let everything = s.claim(&p, "o", 2, 10, t(11)).await.expect("claim");
    assert_eq!(everything.len(), 2);
    let st = s.stats(&p).await.expect("stats");
    assert_eq!((st.total.depth, st.total.claimed), (4, 4));
    assert_eq!(st.total.oldest_pending_created_at, None);
}

pub(crate) async fn partitions_are_independent<S: OutboxHarness + OutboxStore>(s: S) {
    let (p, q) = (unique("p"), unique("q"));
    append_n(&s, &p, &["a"]).await;
    let q_seqs = append_n(&s, &q, &["a", "a"]).await;
    s.claim(&p, "o", 9, 10, t(1)).await.expect("claim");
    let got = s.claim(&q, "o", 1, 10, t(1)).await.expect("claim");
    assert_eq!(seqs(&got), q_seqs);
    assert!(got.iter().all(|r| *r.partition == *q));
    let s = s.reopen().await;
    assert_eq!(s.stats(&p).await.expect("stats").high_water_mark, 9);
    assert_eq!(s.stats(&q).await.expect("stats").high_water_mark, 1);
}

pub(crate) async fn a_message_is_stored_once_until_its_last_record_completes<
    S: OutboxHarness + OutboxStore,
>(
    s: S,
) {
    let p = unique("p");
    let fan_out = msg("fan-out", &["a", "b", "c"]);
    let fan = s.append(&p, fan_out.clone()).await.expect("append");
    let other = append_n(&s, &p, &["a"]).await;
    assert_eq!(s.envelopes(&p).await, Ok(2));
    let got = s.claim(&p, "o", 1, 10, t(1)).await.expect("claim");
    assert_eq!(got.len(), 4);
    // Two of the fan-out's records and the other message are delivered.
    let done = [fan[0], fan[2], other[0]];
    assert_eq!(s.complete(&p, 1, &done).await, Ok(done.to_vec()));
    let s = s.reopen().await;
    assert_eq!(s.envelopes(&p).await, Ok(1));
    let left = s.dump(&p).await.expect("dump");
    assert_eq!(seqs(&left), vec![fan[1]]);
    assert_eq!(
        *left[0].envelope, fan_out.envelope,
        "the envelope outlives two completions"
    );
    // Failed, taken again under a new lease, and finally delivered.
    let failed = Release::Failed {
        error: "e".into(),
        attempted_at: t(2),
    };
    assert_eq!(s.release(&p, 1, &[fan[1]], failed).await, Ok(vec![fan[1]]));
    let again = s.claim(&p, "o", 2, 10, t(3)).await.expect("claim");
    assert_eq!((again.len(), &*again[0].envelope), (1, &fan_out.envelope));
    assert_eq!(s.complete(&p, 2, &[fan[1]]).await, Ok(vec![fan[1]]));
    let s = s.reopen().await;
    assert_eq!(
        s.envelopes(&p).await,
        Ok(0),
        "the envelope goes with its last record"
    );
    assert!(s.dump(&p).await.expect("dump").is_empty());
}

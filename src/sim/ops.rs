//! One function per operation ([`Op`]): each computes the model's
//! expectation, runs the operation on the machine and compares the
//! answers; [`check`] then compares the whole inbox, the effects and the
//! outbox after every step.
//!
//! Invariant: an operation's function updates the model exactly as the
//! engine is expected to change the database; any difference is an `Err`
//! naming what differed.

use super::*;

/// Inline delivery: the model's expected outcome, then the machine's, compared.
pub(super) fn deliver(
    m: &mut Machine,
    model: &mut Model,
    stats: &mut RunStats,
    consumer: &u8,
    id: &u8,
    variant: &u8,
    plan: &Plan,
) -> SimResult<()> {
    let now = m.now_ms();
    let consumer = CONSUMERS[usize::from(*consumer) % 2];
    let key = Model::key(consumer, *id);
    let expected = expect_inline(model, &key, consumer, *id, *variant, *plan, now)?;
    let real = m.deliver(consumer, *id, *variant, *plan)?;
    compare_inline(model, stats, &key, real, expected, now)
}

/// What the model expects of an inline delivery of (`consumer`, `id`) in
/// `variant` now (`None`: the handler's plan crashes it), updating the
/// model as the engine would.
pub(super) fn expect_inline(
    model: &mut Model,
    key: &Key,
    consumer: &str,
    id: u8,
    variant: u8,
    plan: Plan,
    now: i64,
) -> SimResult<Option<Outcome>> {
    Ok(match model.entries.get(key).cloned() {
        None if model.retired.get(key) == Some(&variant) => Some(Outcome::Duplicate),
        Some(e) if e.variant != variant => Some(Outcome::Conflict { conflict_id: 0 }),
        Some(e) => match e.status {
            Status::Completed => Some(Outcome::Duplicate),
            Status::Dead => Some(Outcome::Dead {
                attempts: e.attempts,
                error: String::new(),
            }),
            Status::Processing => return Err("model: processing between steps".into()),
            Status::Pending | Status::Failed => {
                if e.next_at.is_some_and(|at| at > now) {
                    Some(Outcome::Failed {
                        attempts: e.attempts,
                        error: String::new(),
                        retry_after: Duration::from_millis((e.next_at.unwrap_or(now) - now) as u64),
                    })
                } else {
                    model.entries.get_mut(key).expect("entry").attempts += 1;
                    model.attempt(key, plan, now)
                }
            }
        },
        None => {
            // A retired key with another payload: forgotten, new,
            // unless its sequence says otherwise.
            model.retired.remove(key);
            match model.by_sequence(consumer, id, variant) {
                Some(SeqAnswer::Duplicate(sequence)) => {
                    Some(Outcome::DuplicateBySequence { sequence })
                }
                Some(SeqAnswer::Conflict) => Some(Outcome::Conflict { conflict_id: 0 }),
                None => {
                    model.create(key, variant, false).attempts = 1;
                    model.attempt(key, plan, now)
                }
            }
        }
    })
}

/// The machine's answer to an inline delivery (`None`: it crashed)
/// against the model's, counted in `stats`.
pub(super) fn compare_inline(
    model: &mut Model,
    stats: &mut RunStats,
    key: &Key,
    real: Option<Outcome>,
    expected: Option<Outcome>,
    now: i64,
) -> SimResult<()> {
    match (real, expected) {
        (None, None) => {
            stats.crashes += 1;
            model.died(key);
        }
        (Some(Outcome::Conflict { .. }), Some(Outcome::Conflict { .. })) => stats.conflicts += 1,
        // A retired key's duplicate: no row, nothing more to compare.
        (Some(Outcome::Duplicate), Some(Outcome::Duplicate))
            if !model.entries.contains_key(key) => {}
        (
            Some(Outcome::DuplicateBySequence { sequence: a }),
            Some(Outcome::DuplicateBySequence { sequence: b }),
        ) if a == b => stats.by_sequence += 1,
        (Some(real), Some(expected)) => {
            let entry = model.entries.get_mut(key).expect("entry");
            let ok = match (&real, &expected) {
                // Answers given without running: compare the parts
                // that do not depend on stored text.
                (Outcome::Dead { attempts: a, .. }, Outcome::Dead { attempts: b, error })
                    if error.is_empty() =>
                {
                    a == b
                }
                (
                    Outcome::Failed {
                        attempts: a,
                        retry_after: r,
                        ..
                    },
                    Outcome::Failed {
                        attempts: b,
                        retry_after: s,
                        error,
                    },
                ) if error.is_empty() => a == b && r == s,
                _ => same_outcome(&real, &expected, entry, now),
            };
            if !ok {
                return Err(format!("outcome {real:?}, model expected {expected:?}"));
            }
            match real {
                Outcome::Processed { .. } => stats.processed += 1,
                Outcome::Dead { .. } => stats.dead += 1,
                _ => {}
            }
        }
        (real, expected) => return Err(format!("outcome {real:?}, model expected {expected:?}")),
    }
    Ok(())
}

/// A queued receipt of a batch: each receipt against the model's.
pub(super) fn receive(
    m: &mut Machine,
    model: &mut Model,
    stats: &mut RunStats,
    consumer: &u8,
    msgs: &[(u8, u8)],
) -> SimResult<()> {
    let consumer = CONSUMERS[usize::from(*consumer) % 2];
    let mut expected = Vec::new();
    for &(id, variant) in msgs {
        let key = Model::key(consumer, id);
        expected.push(match model.entries.get(&key) {
            None if model.retired.get(&key) == Some(&variant) => Receipt::Duplicate,
            None => {
                model.retired.remove(&key);
                match model.by_sequence(consumer, id, variant) {
                    Some(SeqAnswer::Duplicate(sequence)) => {
                        Receipt::DuplicateBySequence { sequence }
                    }
                    Some(SeqAnswer::Conflict) => Receipt::Conflict { conflict_id: 0 },
                    None => {
                        model.create(&key, variant, true);
                        Receipt::Accepted
                    }
                }
            }
            Some(e) if e.variant == variant => {
                // An acked receipt hands an unfinished inline
                // message over to the workers.
                let e = model.entries.get_mut(&key).expect("entry");
                if matches!(e.status, Status::Pending | Status::Failed) {
                    e.queued = true;
                }
                Receipt::Duplicate
            }
            Some(_) => Receipt::Conflict { conflict_id: 0 },
        });
    }
    let real = m.receive(consumer, msgs)?;
    let strip = |r: &Receipt| match r {
        Receipt::Conflict { .. } => Receipt::Conflict { conflict_id: 0 },
        other => *other,
    };
    let real: Vec<Receipt> = real.iter().map(strip).collect();
    if real != expected {
        return Err(format!("receipts {real:?}, model expected {expected:?}"));
    }
    stats.conflicts += real
        .iter()
        .filter(|r| matches!(r, Receipt::Conflict { .. }))
        .count() as u64;
    stats.by_sequence += real
        .iter()
        .filter(|r| matches!(r, Receipt::DuplicateBySequence { .. }))
        .count() as u64;
    Ok(())
}

/// A batch of transactional queued processing, replayed in the model run by run (a handler's rollback restarts the batch).
pub(super) fn batch(
    m: &mut Machine,
    model: &mut Model,
    stats: &mut RunStats,
    limit: &u8,
    plans: &[Plan],
) -> SimResult<()> {
    let now = m.now_ms();
    let real = m.process(usize::from(*limit), plans)?;
    // Each run the engine makes of the batch starts from the same
    // state: nothing of a run a handler rolled back (or died in)
    // committed. A run first counts the attempts of the rows whose
    // handlers rolled earlier runs back, then processes what is due.
    let start = model.clone();
    let mut poisons: Vec<(String, String)> = Vec::new();
    let mut next_plan = 0;
    let expected = loop {
        *model = start.clone();
        let mut expected = Vec::new();
        for key in &poisons {
            model.entries.get_mut(key).expect("entry").attempts += 1;
            let outcome = model.attempt(key, Plan::RollBack, now).expect("no crash");
            // Backed off (jittered: the check reads the time back),
            // so not due again in this run.
            let entry = model.entries.get_mut(key).expect("entry");
            if entry.status == Status::Failed {
                entry.next_at = Some(now + 1);
            }
            expected.push((key.clone(), outcome));
        }
        let room = usize::from(*limit) - poisons.len();
        let due = model.due(now, u8::try_from(room).unwrap_or(u8::MAX));
        let mut rolled_back = None;
        let mut crashed = false;
        for key in due {
            let plan = plans
                .get(next_plan % plans.len().max(1))
                .copied()
                .unwrap_or(Plan::Ok);
            next_plan += 1;
            model.entries.get_mut(&key).expect("entry").attempts += 1;
            match plan {
                // Nothing of this run committed; the crashed
                // attempt is counted at recovery.
                Plan::Crash => {
                    *model = start.clone();
                    model.entries.get_mut(&key).expect("entry").attempts += 1;
                    model.died(&key);
                    stats.crashes += 1;
                    crashed = true;
                    break;
                }
                Plan::RollBack => {
                    rolled_back = Some(key);
                    break;
                }
                _ => {
                    let outcome = model.attempt(&key, plan, now).expect("no crash");
                    expected.push((key, outcome));
                }
            }
        }
        if crashed {
            break Vec::new();
        }
        match rolled_back {
            Some(key) => {
                stats.rolled_back += 1;
                poisons.push(key);
            }
            None => break expected,
        }
    };
    if real.len() != expected.len() {
        return Err(format!(
            "batch settled {} rows, model expected {}: {real:?} vs {expected:?}",
            real.len(),
            expected.len()
        ));
    }
    for ((c, id, outcome), (key, want)) in real.iter().zip(&expected) {
        if (c, id) != (&key.0, &key.1) {
            return Err(format!(
                "processed {c}/{id}, model expected {}/{}",
                key.0, key.1
            ));
        }
        let entry = model.entries.get_mut(key).expect("entry");
        if !same_outcome(outcome, want, entry, now) {
            return Err(format!("{c}/{id}: {outcome:?}, model expected {want:?}"));
        }
        match outcome {
            Outcome::Processed { .. } => stats.processed += 1,
            Outcome::Dead { .. } => stats.dead += 1,
            _ => {}
        }
    }
    Ok(())
}

/// Claimed effectful rows, each against the model.
pub(super) fn work(
    m: &mut Machine,
    model: &mut Model,
    stats: &mut RunStats,
    limit: &u8,
    plans: &[Plan],
) -> SimResult<()> {
    let now = m.now_ms();
    let due = model.due(now, *limit);
    let real = m.work(usize::from(*limit), plans)?;
    let mut crashed = false;
    let mut completed = 0;
    for (i, key) in due.iter().enumerate() {
        if crashed {
            // Claimed in the same batch, never started: handed
            // back at recovery, its claim's attempt uncounted.
            continue;
        }
        model.entries.get_mut(key).expect("entry").attempts += 1;
        let plan = plans
            .get(i % plans.len().max(1))
            .copied()
            .unwrap_or(Plan::Ok);
        let Some(expected) = model.attempt(key, plan, now) else {
            crashed = true;
            stats.crashes += 1;
            model.died(key);
            continue;
        };
        let Some((c, id, outcome)) = real.get(i) else {
            return Err(format!("worked {} rows, model expected more", real.len()));
        };
        if (c, id) != (&key.0, &key.1) {
            return Err(format!(
                "claimed {c}/{id}, model expected {}/{}",
                key.0, key.1
            ));
        }
        let entry = model.entries.get_mut(key).expect("entry");
        if !same_outcome(outcome, &expected, entry, now) {
            return Err(format!(
                "{c}/{id}: {outcome:?}, model expected {expected:?}"
            ));
        }
        match outcome {
            Outcome::Processed { .. } => stats.processed += 1,
            Outcome::Dead { .. } => stats.dead += 1,
            _ => {}
        }
        completed += 1;
    }
    if real.len() != completed {
        return Err(format!(
            "worked {} rows, model expected {completed}",
            real.len()
        ));
    }
    Ok(())
}

/// A retention pass: the rows the model retires, counted against the deletions.
pub(super) fn cleanup(
    m: &mut Machine,
    model: &mut Model,
    retention_ms: &u32,
    keys: &bool,
) -> SimResult<()> {
    let now = m.now_ms();
    let cutoff = now - i64::from(*retention_ms);
    let before = model.entries.len();
    // A walk in receive order (`store::sweep`): from the first entry, or
    // from where the last pass stopped while its cutoff is no later than
    // the last walk from the first; completed entries before the cutoff
    // go, a younger completed one or the newest (kept, whatever its age)
    // ends the walk, the rest are stepped over.
    let whole = match (model.frontier, model.swept_at) {
        (Some(_), Some(swept_at)) => cutoff > swept_at,
        _ => true,
    };
    let old_frontier = model.frontier;
    let from = if whole { 0 } else { old_frontier.unwrap_or(0) };
    let newest = model.entries.values().map(|e| e.order).max();
    let mut walked: Vec<_> = model
        .entries
        .iter()
        .filter(|(_, e)| e.order >= from && Some(e.order) != newest)
        .map(|(key, e)| (e.order, key.clone(), e.status, e.processed_at))
        .collect();
    walked.sort_by_key(|w| w.0);
    let mut stop = newest.unwrap_or(from).max(from);
    let (mut expired, mut young) = (Vec::new(), None::<i64>);
    for (order, key, status, processed_at) in walked {
        match (status, processed_at) {
            (Status::Completed, Some(at)) if at < cutoff => expired.push(key),
            // Completed as the pass runs: stepped over.
            (Status::Completed, Some(at)) if at >= now => {}
            // Completed after an earlier pass stepped over it: stepped
            // over, and the next walk from the first entry comes when it
            // is old enough.
            (Status::Completed, Some(at)) if whole && old_frontier.is_some_and(|f| order < f) => {
                young = Some(young.map_or(at, |y| y.min(at)));
            }
            (Status::Completed, Some(_)) => {
                stop = order;
                break;
            }
            _ => {}
        }
    }
    model.frontier = Some(stop);
    if whole {
        model.swept_at = Some(young.map_or(now, |y| y.min(now)));
    }
    for key in expired {
        if let Some(e) = model.entries.remove(&key) {
            model.retired.insert(key.clone(), e.variant);
            model.next_note += 1;
            model.notes.push((model.next_note, key));
        }
    }
    if *keys {
        model.retired.clear();
        model.notes.clear();
    }
    let n = m.cleanup(*retention_ms, *keys)?;
    if n != before - model.entries.len() {
        return Err(format!(
            "cleanup deleted {n}, model expected {}",
            before - model.entries.len()
        ));
    }
    Ok(())
}

/// The first half of a split drain: the model notes what it read.
pub(super) fn read_retired(m: &mut Machine, model: &mut Model) -> SimResult<()> {
    m.read_retired()?;
    model.read_retired = model.notes.last().map(|&(last, _)| {
        let keys = model.notes.iter().map(|(_, key)| key.clone()).collect();
        (keys, last)
    });
    Ok(())
}

/// The second half of a split drain: the deletions against the model.
pub(super) fn apply_retired(
    m: &mut Machine,
    model: &mut Model,
    stats: &mut RunStats,
) -> SimResult<()> {
    let real = m.apply_retired()?;
    let mut expected = 0;
    if let Some((keys, last)) = model.read_retired.take() {
        for key in keys {
            if model.retired.remove(&key).is_some() {
                expected += 1;
            } else if model.entries.contains_key(&key) {
                stats.live_at_apply += 1;
            }
        }
        model.notes.retain(|&(seq, _)| seq > last);
    }
    if real != expected {
        return Err(format!(
            "a split drain deleted {real} key entries, model expected {expected}"
        ));
    }
    Ok(())
}

/// A consumer's sequence reset (a new epoch).
pub(super) fn reset_sequence(
    m: &mut Machine,
    model: &mut Model,
    stats: &mut RunStats,
    consumer: &u8,
) -> SimResult<()> {
    let consumer = CONSUMERS[usize::from(*consumer) % 2];
    m.reset_sequence(consumer)?;
    model.settled.remove(consumer);
    for ((c, _), e) in model.entries.iter_mut() {
        if c == consumer {
            e.numbered = false;
        }
    }
    stats.resets += 1;
    Ok(())
}

/// The whole inbox, every effect count and every outbox count against the
/// model.
pub(super) fn check(m: &Machine, model: &Model) -> SimResult<()> {
    let mut broken = Vec::new();
    crate::store::inbox::key_mismatches(m.conn(), |table, id, what| {
        broken.push(format!("{table} {id}: {what}"))
    })
    .map_err(|e| format!("check inbox keys: {e}"))?;
    if !broken.is_empty() {
        return Err(format!("key table: {}", broken.join("; ")));
    }
    let retired = m.effects(
        "SELECT consumer, message_id, 1 FROM postroom_inbox_keys k
         WHERE NOT EXISTS (SELECT 1 FROM postroom_inbox i
                           WHERE i.id = k.inbox_id AND i.consumer = k.consumer
                             AND i.source = k.source AND i.message_id = k.message_id)",
    )?;
    if !retired.keys().eq(model.retired.keys()) {
        return Err(format!(
            "retired key entries {:?}, model {:?}",
            retired.keys().collect::<Vec<_>>(),
            model.retired
        ));
    }
    let inbox = m.inbox()?;
    if inbox.len() != model.entries.len() {
        return Err(format!(
            "{} inbox rows, model has {}",
            inbox.len(),
            model.entries.len()
        ));
    }
    for (key, e) in &model.entries {
        let Some(&(status, attempts, next_at)) = inbox.get(key) else {
            return Err(format!("{key:?} missing from the inbox"));
        };
        if (status, attempts) != (e.status, e.attempts) {
            return Err(format!(
                "{key:?}: inbox has {status}/{attempts}, model {}/{}",
                e.status, e.attempts
            ));
        }
        // Due at once is NULL, not a time (schema.sql); a retry's time is
        // exact (a panic's jittered one was read back from its outcome).
        if matches!(e.status, Status::Pending | Status::Failed) && next_at != e.next_at {
            return Err(format!(
                "{key:?}: next_attempt_at {next_at:?}, model {:?}",
                e.next_at
            ));
        }
    }
    for consumer in CONSUMERS {
        let (below, listed) = m.watermark(consumer)?;
        let (w, model_listed) = model.watermark(consumer);
        if (below.saturating_sub(1), &listed) != (w, &model_listed) {
            return Err(format!(
                "{consumer}: watermark {} listing {listed:?}, model {w} listing {model_listed:?}",
                below.saturating_sub(1)
            ));
        }
    }
    let applied =
        m.effects("SELECT consumer, message_id, count(*) FROM sim_effects GROUP BY 1, 2")?;
    let published = m.effects(
        "SELECT cause_consumer, cause_message_id, count(*) FROM postroom_outbox GROUP BY 1, 2",
    )?;
    let expected: BTreeMap<_, _> = model
        .applied
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| (k.clone(), *n))
        .collect();
    if applied != expected {
        return Err(format!("effects {applied:?}, model {expected:?}"));
    }
    if published != expected {
        return Err(format!("outbox rows {published:?}, model {expected:?}"));
    }
    // Derived ids are unique by construction, with no index to say so.
    let mut repeated = Vec::new();
    crate::store::check::duplicate_outbox_ids(m.conn(), |seq, first| repeated.push((seq, first)))
        .map_err(|e| e.to_string())?;
    if !repeated.is_empty() {
        return Err(format!(
            "outbox rows (seq, first with its id): {repeated:?}"
        ));
    }
    Ok(())
}

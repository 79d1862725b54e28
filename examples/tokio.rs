//! postroom from async code: the engine's calls block until their commit
//! is durable, so async tasks call them through `spawn_blocking`, sharing
//! one engine as an `Arc<Postroom>`. Many tasks delivering at once is what
//! group commit is for: their messages share fsyncs.
//!
//! `cargo run --example tokio`

use std::sync::Arc;
use std::time::Duration;

use postroom::{handler_fn, Message, Outcome, Postroom};

/// `Postroom::deliver` off the runtime's worker threads.
async fn deliver(
    room: Arc<Postroom>,
    consumer: &'static str,
    msg: Message,
) -> postroom::Result<Outcome> {
    tokio::task::spawn_blocking(move || room.deliver(consumer, msg))
        .await
        .expect("deliver does not panic")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("postroom-tokio-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("app.db");

    // Opening recovers and may check the file: blocking too.
    let room = tokio::task::spawn_blocking(move || -> postroom::Result<Arc<Postroom>> {
        let room = Postroom::builder()
            .consumer(
                "clicks",
                handler_fn(|tx, msg| {
                    tx.execute("INSERT INTO clicks (id) VALUES (?1)", [msg.id()])?;
                    Ok(())
                }),
            )
            .open(path)?;
        room.transaction(|tx| {
            tx.execute_batch("CREATE TABLE IF NOT EXISTS clicks (id TEXT PRIMARY KEY)")?;
            Ok(())
        })?;
        Ok(Arc::new(room))
    })
    .await??;

    // A broker consumer would spawn one task per message like this; every
    // message arrives twice (at-least-once).
    let mut tasks = Vec::new();
    for round in 0..2 {
        for i in 0..200 {
            let msg = Message::new("web", format!("click-{i}"), "{}");
            tasks.push((
                round,
                tokio::spawn(deliver(Arc::clone(&room), "clicks", msg)),
            ));
        }
    }
    let (mut processed, mut duplicates) = (0, 0);
    for (_, task) in tasks {
        match task.await?? {
            Outcome::Processed { .. } => processed += 1,
            Outcome::Duplicate => duplicates += 1,
            other => return Err(format!("unexpected outcome {other:?}").into()),
        }
    }
    assert_eq!((processed, duplicates), (200, 200));

    let reader = Arc::clone(&room);
    let stored: i64 = tokio::task::spawn_blocking(move || {
        reader.transaction(|tx| Ok(tx.query_row("SELECT count(*) FROM clicks", [], |r| r.get(0))?))
    })
    .await??;
    assert_eq!(stored, 200);
    let stats = Arc::clone(&room);
    let stats = tokio::task::spawn_blocking(move || stats.stats()).await??;
    println!(
        "400 deliveries from 400 tasks: {processed} processed, {duplicates} duplicates, \
         {stored} rows, {} commits",
        stats.batches_committed
    );

    tokio::task::spawn_blocking(move || room.shutdown(Duration::from_secs(5))).await??;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

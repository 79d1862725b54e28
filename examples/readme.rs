use std::sync::mpsc;
use std::time::Duration;

use postroom::{
    handler_fn, sink_fn, Failure, Message, Outcome, Outgoing, Postroom, SendResult, Tx,
};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct OrderPaid {
    order_id: i64,
}

/// Runs inside the transaction that records the message in the inbox.
fn on_order_paid(tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
    let paid: OrderPaid = msg.json()?; // does not decode: dead at once
    let sql = "UPDATE orders SET paid = paid + 1 WHERE id = ?1";
    tx.execute(sql, [paid.order_id])?;
    // An outbox row: committed with the update, or not at all.
    let request = Outgoing::json("shipping.requested", &paid)?;
    tx.publish(request.with_key(paid.order_id.to_string()))?;
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("postroom-readme-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;

    // Stands in for your broker's producer (see "The outbox relay" below).
    let (shipping, shipped) = mpsc::channel::<Vec<u8>>();
    let room = Postroom::builder()
        .consumer("billing", handler_fn(on_order_paid))
        .sink(sink_fn(move |m| match shipping.send(m.payload.clone()) {
            Ok(()) => SendResult::Sent, // the receiver has it
            Err(e) => SendResult::retry(e),
        }))
        .open(dir.join("app.db"))?;

    // Your tables live in the same file.
    room.transaction(|tx| {
        tx.execute_batch(
            "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, paid INTEGER NOT NULL);
             INSERT OR IGNORE INTO orders VALUES (7, 0);",
        )?;
        Ok(())
    })?;

    // In your broker's callback: deliver, then ack as the outcome says.
    let msg = Message::from_json("payments", "evt-1", &OrderPaid { order_id: 7 })?;
    let outcome = room.deliver("billing", msg.clone())?;
    assert_eq!(outcome, Outcome::Processed { attempts: 1 });
    assert!(outcome.should_ack());

    // The broker redelivers it: recognised, the handler does not run again.
    assert_eq!(room.deliver("billing", msg)?, Outcome::Duplicate);
    let paid: i64 = room.transaction(|tx| {
        Ok(tx.query_row("SELECT paid FROM orders WHERE id = 7", [], |r| r.get(0))?)
    })?;
    assert_eq!(paid, 1);

    // The relay hands the published message over once its commit is durable.
    let request = shipped.recv_timeout(Duration::from_secs(10))?;
    println!("shipping requested: {}", String::from_utf8_lossy(&request));

    room.shutdown(Duration::from_secs(5))?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

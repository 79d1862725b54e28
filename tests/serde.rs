//! The public value types serialize with serde, in the shapes an
//! application would log or ship: outcomes tagged by name, statuses in
//! snake case, and messages that come back equal.

use std::time::Duration;

use postroom::{handler_fn, Failure, Message, Outcome, Postroom, Receipt, Stats, Status};

#[test]
fn outcomes_and_receipts_are_tagged_by_name() {
    let failed = Outcome::Failed {
        attempts: 2,
        error: "timeout".into(),
        retry_after: Duration::from_millis(1500),
    };
    let json = serde_json::to_value(&failed).unwrap();
    assert_eq!(json["outcome"], "failed");
    assert_eq!(json["attempts"], 2);
    assert_eq!(json["error"], "timeout");
    let back: Outcome = serde_json::from_value(json).unwrap();
    assert_eq!(back, failed);

    assert_eq!(
        serde_json::to_string(&Outcome::Duplicate).unwrap(),
        r#"{"outcome":"duplicate"}"#
    );
    assert_eq!(
        serde_json::to_string(&Receipt::Conflict { conflict_id: 3 }).unwrap(),
        r#"{"receipt":"conflict","conflict_id":3}"#
    );
    assert_eq!(serde_json::to_string(&Status::Dead).unwrap(), r#""dead""#);
}

#[test]
fn a_message_round_trips_and_may_omit_headers_and_key() {
    let msg = Message::new("orders", "evt-1", b"\x00\xffpayload".to_vec())
        .with_header("trace", "abc")
        .with_ordering_key("order-7");
    let back: Message = serde_json::from_str(&serde_json::to_string(&msg).unwrap()).unwrap();
    assert_eq!(back, msg);

    let minimal: Message =
        serde_json::from_str(r#"{"source":"s","id":"m","payload":[104,105]}"#).unwrap();
    assert_eq!(minimal, Message::new("s", "m", "hi"));
}

/// Stats and dead letters read from a real database serialize, and stats
/// come back equal.
#[test]
fn stats_and_dead_letters_from_a_database_serialize() {
    let dir = tempfile::tempdir().unwrap();
    let room = Postroom::builder()
        .consumer(
            "c",
            handler_fn(|_, msg| match msg.id() {
                "bad" => Err(Failure::reject("no")),
                _ => Ok(()),
            }),
        )
        .open(dir.path().join("app.db"))
        .unwrap();
    room.deliver("c", Message::new("s", "good", "1")).unwrap();
    room.deliver("c", Message::new("s", "bad", "2")).unwrap();

    let stats = room.stats().unwrap();
    let json = serde_json::to_value(&stats).unwrap();
    assert_eq!(json["inbox"]["c"]["completed"], 1, "{json}");
    assert_eq!(json["inbox"]["c"]["dead"], 1, "{json}");
    let back: Stats = serde_json::from_value(json).unwrap();
    assert_eq!(back, stats);

    let dead = room.dead_letters(Some("c"), 10).unwrap();
    let json = serde_json::to_value(&dead).unwrap();
    assert_eq!(json[0]["message"]["id"], "bad", "{json}");
    assert_eq!(json[0]["last_error"], "no", "{json}");
    room.shutdown(Duration::from_secs(5)).unwrap();
}

//! The testkit (feature `testkit`) aimed at `order_service`'s handler: an
//! `OrderPaid` event marks the order paid and requests shipping. The first
//! version also emails the customer by writing outside the transaction
//! (here: a line in a file, standing in for an SMTP call); the testkit
//! finds the seed where the transaction is lost after the handler ran (a
//! crash before the commit, a rollback, a full disk: seed 0 has a full
//! disk) and the redelivery sends the email twice, shrinks the schedule to
//! that one fault and prints the command that replays it. The fixed version publishes the email request through the
//! outbox instead, in the same transaction, and passes every seed.
//!
//! The scenarios are in `testkit_orders/scenarios.rs`, which the fuzz
//! target `testkit_orders` includes too.
//!
//! ```text
//! cargo run --example testkit_orders --features testkit
//! POSTROOM_TESTKIT_SEEDS=1000 cargo run --release --example testkit_orders --features testkit
//! ```

#[path = "testkit_orders/scenarios.rs"]
mod scenarios;

use scenarios::{buggy, fixed};

fn main() {
    println!("version 1: the email is sent outside the transaction");
    match buggy().try_run() {
        Ok(report) => {
            println!("{report}");
            eprintln!("expected the testkit to catch the double email");
            std::process::exit(1);
        }
        Err(failed) => println!("{failed}\n"),
    }
    println!("version 2: the email request goes through the outbox");
    // Prints what fired (on stderr); panics with the failure otherwise.
    fixed().run();
}

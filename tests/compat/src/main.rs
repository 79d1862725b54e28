//! An app on the newest rusqlite: its own connection and postroom's share
//! one SQLite file and one rusqlite.

use postroom::{handler_fn, Message, Outcome, Postroom};

/// The app's own code, written against its own rusqlite.
fn count(stmt: &mut rusqlite::Statement<'_>) -> rusqlite::Result<i64> {
    stmt.query_row([], |r| r.get(0))
}

fn count_notes(conn: &rusqlite::Connection) -> rusqlite::Result<i64> {
    count(&mut conn.prepare("SELECT count(*) FROM notes")?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("postroom-compat-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("app.db");

    let app = rusqlite::Connection::open(&path)?;
    app.execute_batch("CREATE TABLE notes (body TEXT NOT NULL)")?;

    let room = Postroom::builder()
        .consumer(
            "notes",
            handler_fn(|tx, msg| {
                tx.execute(
                    "INSERT INTO notes (body) VALUES (?1)",
                    [String::from_utf8_lossy(msg.payload())],
                )?;
                // `Tx::prepare` hands out postroom's `rusqlite::Statement`:
                // this only compiles when that is the app's rusqlite, not a
                // second copy.
                let seen = count(&mut tx.prepare("SELECT count(*) FROM notes")?)?;
                assert!(seen >= 1);
                Ok(())
            }),
        )
        .open(&path)?;
    let msg = Message::new("app", "note-1", "hello");
    assert_eq!(
        room.deliver("notes", msg.clone())?,
        Outcome::Processed { attempts: 1 }
    );
    assert_eq!(room.deliver("notes", msg)?, Outcome::Duplicate);
    room.shutdown(std::time::Duration::from_secs(5))?;

    assert_eq!(count_notes(&app)?, 1);
    println!(
        "an app on rusqlite 0.43 with postroom: one SQLite {}, one note",
        rusqlite::version()
    );
    // Closed first: Windows refuses to remove a file that is open.
    drop(app);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

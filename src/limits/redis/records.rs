//! Admin records in Redis: one hash per kind (fields are HMACs of what a
//! record is about, values its JSON) and one version number that every
//! change moves, so that each instance re-reads the records only when they
//! changed. All under one hash tag: one slot on a cluster.

use redis::Value;

use super::batch::Batches;
use super::conn::Connection;
use crate::limits::keys::KeyHasher;
use crate::limits::{RecordChanges, StoreError};

fn reply(what: &str, value: &Value) -> StoreError {
    StoreError::Reply(format!("{what}: unexpected reply {value:?}"))
}

/// The version number; 0 before any record was put.
pub async fn version(batches: &Batches<Connection>, keys: &KeyHasher) -> Result<u64, StoreError> {
    let mut cmd = redis::cmd("GET");
    cmd.arg(keys.records_version());
    match batches.query(cmd).await? {
        Value::Nil => Ok(0),
        Value::BulkString(bytes) => std::str::from_utf8(&bytes)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| reply("records version", &Value::BulkString(bytes))),
        Value::Int(n) => Ok(n.max(0) as u64),
        other => Err(reply("records version", &other)),
    }
}

/// Every record of `kind`.
pub async fn all(
    batches: &Batches<Connection>,
    keys: &KeyHasher,
    kind: &str,
) -> Result<Vec<String>, StoreError> {
    let mut cmd = redis::cmd("HVALS");
    cmd.arg(keys.records(kind));
    match batches.query(cmd).await? {
        Value::Array(values) => values
            .into_iter()
            .map(|v| match v {
                Value::BulkString(bytes) => String::from_utf8(bytes)
                    .map_err(|_| StoreError::Reply("a record is not text".into())),
                other => Err(reply("records", &other)),
            })
            .collect(),
        Value::Nil => Ok(Vec::new()),
        other => Err(reply("records", &other)),
    }
}

/// The record of `kind` under `field`.
pub async fn get(
    batches: &Batches<Connection>,
    keys: &KeyHasher,
    kind: &str,
    field: &str,
) -> Result<Option<String>, StoreError> {
    let mut cmd = redis::cmd("HGET");
    cmd.arg(keys.records(kind)).arg(field);
    match batches.query(cmd).await? {
        Value::Nil => Ok(None),
        Value::BulkString(bytes) => String::from_utf8(bytes)
            .map(Some)
            .map_err(|_| StoreError::Reply("a record is not text".into())),
        other => Err(reply("record", &other)),
    }
}

/// The most changes the feed keeps (approximately: trimmed by whole
/// nodes); an instance that falls further behind drops all it cached.
const FEED_LEN: u64 = 100_000;

/// The most changes read from the feed in one call.
const FEED_READ: u64 = 5_000;

/// Puts or removes the record under `field`, appends the change to the
/// feed, then moves the version.
pub async fn put(
    batches: &Batches<Connection>,
    keys: &KeyHasher,
    kind: &str,
    field: &str,
    value: Option<&str>,
) -> Result<bool, StoreError> {
    let hash = keys.records(kind);
    let mut cmd = match value {
        Some(v) => {
            let mut c = redis::cmd("HSET");
            c.arg(&hash).arg(field).arg(v);
            c
        }
        None => {
            let mut c = redis::cmd("HDEL");
            c.arg(&hash).arg(field);
            c
        }
    };
    let was = match batches
        .query(std::mem::replace(&mut cmd, redis::cmd("INCR")))
        .await?
    {
        // HSET answers the fields it added (0: replaced one), HDEL those it
        // removed.
        Value::Int(n) => match value {
            Some(_) => n == 0,
            None => n > 0,
        },
        other => return Err(reply("record", &other)),
    };
    let mut feed = redis::cmd("XADD");
    feed.arg(keys.records_feed())
        .arg("MAXLEN")
        .arg("~")
        .arg(FEED_LEN)
        .arg("*")
        .arg("kind")
        .arg(kind)
        .arg("field")
        .arg(field);
    batches.query(feed).await?;
    cmd.arg(keys.records_version());
    batches.query(cmd).await?;
    Ok(was)
}

/// The changes after `cursor` (an entry id of the feed; empty: start at the
/// feed's end).
pub async fn changes(
    batches: &Batches<Connection>,
    keys: &KeyHasher,
    cursor: &str,
) -> Result<RecordChanges, StoreError> {
    let feed = keys.records_feed();
    let range = |from: &str, to: &str, count: u64| {
        let mut cmd = redis::cmd("XRANGE");
        cmd.arg(&feed).arg(from).arg(to).arg("COUNT").arg(count);
        cmd
    };
    let entries = |v: Value| match v {
        Value::Array(entries) => Ok(entries),
        Value::Nil => Ok(Vec::new()),
        other => Err(reply("change feed", &other)),
    };
    if cursor.is_empty() {
        let mut last = redis::cmd("XREVRANGE");
        last.arg(&feed).arg("+").arg("-").arg("COUNT").arg(1);
        let last = entries(batches.query(last).await?)?;
        let cursor = match last.into_iter().next() {
            Some(Value::Array(parts)) => parts.first().and_then(text),
            _ => None,
        };
        return Ok(RecordChanges {
            cursor: cursor.unwrap_or_else(|| "0-0".into()),
            changed: Vec::new(),
            complete: true,
        });
    }
    // Entries leave the feed only by trimming, oldest first: while the one
    // read last is there, nothing after it is lost. (From an empty feed,
    // "0-0", nothing can be told.)
    let complete =
        cursor == "0-0" || !entries(batches.query(range(cursor, cursor, 1)).await?)?.is_empty();
    let read = range(&format!("({cursor}"), "+", FEED_READ);
    let mut out = RecordChanges {
        cursor: cursor.to_owned(),
        changed: Vec::new(),
        complete,
    };
    for entry in entries(batches.query(read).await?)? {
        let Value::Array(mut parts) = entry else {
            return Err(reply("change feed entry", &entry));
        };
        let (Some(fields), Some(id)) = (parts.pop(), parts.pop().as_ref().and_then(text)) else {
            return Err(StoreError::Reply(
                "a change feed entry without id or fields".into(),
            ));
        };
        let fields = pairs(fields);
        let get = |name: &str| {
            fields
                .iter()
                .find(|(k, _)| k == name)
                .and_then(|(_, v)| text(v))
        };
        if let (Some(kind), Some(field)) = (get("kind"), get("field")) {
            out.changed.push((kind, field));
        }
        out.cursor = id;
    }
    Ok(out)
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

/// A reply of name/value pairs: a flat array (RESP2) or a map (RESP3).
fn pairs(v: Value) -> Vec<(String, Value)> {
    match v {
        Value::Array(items) => {
            let mut out = Vec::with_capacity(items.len() / 2);
            let mut items = items.into_iter();
            while let (Some(k), Some(v)) = (items.next(), items.next()) {
                if let Some(k) = text(&k) {
                    out.push((k, v));
                }
            }
            out
        }
        Value::Map(items) => items
            .into_iter()
            .filter_map(|(k, v)| Some((text(&k)?, v)))
            .collect(),
        _ => Vec::new(),
    }
}

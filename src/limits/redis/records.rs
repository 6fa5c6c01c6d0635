//! Admin records in Redis: one hash per kind (fields are HMACs of what a
//! record is about, values its JSON) and one version number that every
//! change moves, so that each instance re-reads the records only when they
//! changed. All under one hash tag: one slot on a cluster.

use redis::Value;

use super::batch::Batches;
use super::conn::Connection;
use crate::limits::keys::KeyHasher;
use crate::limits::StoreError;

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

/// Puts or removes the record about `id`, then moves the version.
pub async fn put(
    batches: &Batches<Connection>,
    keys: &KeyHasher,
    kind: &str,
    id: &str,
    value: Option<&str>,
) -> Result<bool, StoreError> {
    let (hash, field) = keys.record(kind, id);
    let mut cmd = match value {
        Some(v) => {
            let mut c = redis::cmd("HSET");
            c.arg(&hash).arg(&field).arg(v);
            c
        }
        None => {
            let mut c = redis::cmd("HDEL");
            c.arg(&hash).arg(&field);
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
    cmd.arg(keys.records_version());
    batches.query(cmd).await?;
    Ok(was)
}

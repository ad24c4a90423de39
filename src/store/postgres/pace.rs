//! Rate-limit budgets shared by replicas (see `crate::pace`): each claim of sends for one
//! account takes the account's row lock, drops the sends older than the window, and grants
//! what the window has room for, recorded at the database's time — so replicas together never
//! send more than the limit in any window, whatever their clocks say.

use super::*;

impl PgStore {
    pub(super) async fn claim(&self, claim: SendClaim<'_>) -> StoreResult<(u32, Duration)> {
        let SendClaim {
            upstream,
            scope,
            want,
            limit,
            window,
        } = claim;
        let window_ms = window.as_millis().min(i64::MAX as u128) as i64;
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO idem_pace (upstream, scope) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(upstream)
        .bind(scope)
        .execute(&mut *tx)
        .await?;
        let now: i64 = sqlx::query_scalar(&format!(
            "SELECT {NOW} FROM idem_pace WHERE upstream = $1 AND scope = $2 FOR UPDATE"
        ))
        .bind(upstream)
        .bind(scope)
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM idem_pace_sends WHERE upstream = $1 AND scope = $2 AND at <= $3")
            .bind(upstream)
            .bind(scope)
            .bind(now - window_ms)
            .execute(&mut *tx)
            .await?;
        let sent: Vec<(i64, i32)> = sqlx::query_as(
            "SELECT at, n FROM idem_pace_sends WHERE upstream = $1 AND scope = $2 ORDER BY at",
        )
        .bind(upstream)
        .bind(scope)
        .fetch_all(&mut *tx)
        .await?;
        let used: i64 = sent.iter().map(|(_, n)| i64::from(*n)).sum();
        let room = (i64::from(limit) - used).max(0);
        let granted = i64::from(want).min(room) as u32;
        if granted > 0 {
            sqlx::query(
                "INSERT INTO idem_pace_sends (upstream, scope, at, n) VALUES ($1, $2, $3, $4)",
            )
            .bind(upstream)
            .bind(scope)
            .bind(now)
            .bind(granted as i32)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok((granted, room_in(&sent, used, limit, now, window_ms)))
    }
}

/// How long until one more send fits, when none does now: until enough of the window's sends
/// have aged out of it.
fn room_in(sent: &[(i64, i32)], used: i64, limit: u32, now: i64, window_ms: i64) -> Duration {
    let mut left = used;
    for (at, n) in sent {
        if left < i64::from(limit) {
            break;
        }
        left -= i64::from(*n);
        if left < i64::from(limit) {
            return Duration::from_millis((at + window_ms - now).max(0) as u64);
        }
    }
    Duration::ZERO
}

#[cfg(test)]
mod tests {
    use super::room_in;
    use std::time::Duration;

    #[test]
    fn room_comes_when_enough_sends_age_out() {
        // Ten a second, all ten used at 100 and 400 ms; now is 600 ms.
        let sent = [(100, 4), (400, 6)];
        assert_eq!(
            room_in(&sent, 10, 10, 600, 1000),
            Duration::from_millis(500)
        );
        assert_eq!(room_in(&sent, 10, 11, 600, 1000), Duration::ZERO);
        let over = [(100, 1), (400, 12)];
        assert_eq!(
            room_in(&over, 13, 10, 600, 1000),
            Duration::from_millis(800)
        );
    }
}

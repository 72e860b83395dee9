//! The Prometheus text exposition, read back (pure): the samples of the operator's `/metrics`
//! and the API server's `/metrics`, sums by label, and quantiles of a histogram's bucket deltas.

use std::collections::BTreeMap;

/// One sample line: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name (with `_total`, `_bucket`, … suffix as exposed).
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Value.
    pub value: f64,
}

/// Every sample of `text`; comment and malformed lines are skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, rest) = match line.find('{') {
        Some(i) => (&line[..i], &line[i..]),
        None => {
            let (n, r) = line.split_once(' ')?;
            (n, r)
        }
    };
    let mut labels = BTreeMap::new();
    let rest = if let Some(body) = rest.strip_prefix('{') {
        let end = closing_brace(body)?;
        parse_labels(&body[..end], &mut labels)?;
        &body[end + 1..]
    } else {
        rest
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// Index of the `}` closing a label set (quotes and escapes respected).
fn closing_brace(body: &str) -> Option<usize> {
    let mut in_quotes = false;
    let mut escaped = false;
    for (i, c) in body.char_indices() {
        match (in_quotes, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, false, '"') => in_quotes = !in_quotes,
            (false, _, '}') => return Some(i),
            _ => {}
        }
    }
    None
}

fn parse_labels(body: &str, out: &mut BTreeMap<String, String>) -> Option<()> {
    let mut rest = body.trim();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=')?;
        let after = after.strip_prefix('"')?;
        let mut value = String::new();
        let mut escaped = false;
        let mut end = None;
        for (i, c) in after.char_indices() {
            if escaped {
                value.push(match c {
                    'n' => '\n',
                    other => other,
                });
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                end = Some(i);
                break;
            } else {
                value.push(c);
            }
        }
        out.insert(key.trim().trim_start_matches(',').trim().to_owned(), value);
        rest = after[end? + 1..].trim_start_matches(',').trim();
    }
    Some(())
}

/// Sum of the samples named `name` whose labels include every pair of `filter`.
pub fn sum(samples: &[Sample], name: &str, filter: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            filter
                .iter()
                .all(|(k, v)| s.labels.get(*k).is_some_and(|x| x == v))
        })
        .map(|s| s.value)
        .sum()
}

/// Sums of the samples named `name` grouped by the values of `keys` (joined with `/`).
pub fn sum_by(samples: &[Sample], name: &str, keys: &[&str]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for s in samples.iter().filter(|s| s.name == name) {
        let key: Vec<&str> = keys
            .iter()
            .map(|k| s.labels.get(*k).map_or("", String::as_str))
            .collect();
        *out.entry(key.join("/")).or_insert(0.0) += s.value;
    }
    out
}

/// Cumulative bucket counts `(le, count)` of histogram `name` (`<name>_bucket`), summed over
/// every other label, ascending by `le`.
pub fn buckets(samples: &[Sample], name: &str) -> Vec<(f64, f64)> {
    let mut by_le: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    let bucket = format!("{name}_bucket");
    for s in samples.iter().filter(|s| s.name == bucket) {
        let Some(le) = s.labels.get("le") else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            match le.parse::<f64>() {
                Ok(v) => v,
                Err(_) => continue,
            }
        };
        let e = by_le.entry(le.to_bits()).or_insert((le, 0.0));
        e.1 += s.value;
    }
    let mut v: Vec<(f64, f64)> = by_le.into_values().collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// The bucket deltas `after − before` of two cumulative bucket lists (same bounds).
pub fn bucket_delta(before: &[(f64, f64)], after: &[(f64, f64)]) -> Vec<(f64, f64)> {
    after
        .iter()
        .map(|&(le, n)| {
            let b = before
                .iter()
                .find(|(l, _)| l.to_bits() == le.to_bits())
                .map_or(0.0, |x| x.1);
            (le, (n - b).max(0.0))
        })
        .collect()
}

/// The upper bound of the bucket holding the `q`-quantile of cumulative `buckets` (nearest rank):
/// "the q-quantile is at most this". `None` without observations; infinite when it lies in the
/// `+Inf` bucket.
pub fn quantile_bound(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = (q.clamp(0.0, 1.0) * total).ceil().max(1.0);
    buckets.iter().find(|(_, n)| *n >= rank).map(|(le, _)| *le)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP x y
# TYPE tandem_operator_writes counter
tandem_operator_writes_total{kind="DecodePool",verb="apply"} 3
tandem_operator_writes_total{kind="CacheTier",verb="status"} 2
apiserver_request_total{code="200",resource="pods",verb="LIST",x="a,b}"} 7
apiserver_request_total{code="201",resource="pods",verb="POST"} 5
apiserver_request_total{code="200",resource="nodes",verb="LIST"} 1
h_bucket{kind="a",le="0.001"} 1
h_bucket{kind="a",le="0.01"} 8
h_bucket{kind="a",le="+Inf"} 10
h_bucket{kind="b",le="0.001"} 0
h_bucket{kind="b",le="0.01"} 0
h_bucket{kind="b",le="+Inf"} 0
up 1
"#;

    #[test]
    fn parses_sums_and_groups() {
        let s = parse(TEXT);
        assert_eq!(sum(&s, "tandem_operator_writes_total", &[]), 5.0);
        assert_eq!(
            sum(&s, "tandem_operator_writes_total", &[("verb", "apply")]),
            3.0
        );
        let by = sum_by(&s, "apiserver_request_total", &["verb", "resource"]);
        assert_eq!(by["LIST/pods"], 7.0);
        assert_eq!(by["POST/pods"], 5.0);
        assert_eq!(sum(&s, "up", &[]), 1.0);
    }

    #[test]
    fn quantiles_are_bucket_bounds_of_the_delta() {
        let s = parse(TEXT);
        let b = buckets(&s, "h");
        assert_eq!(b, vec![(0.001, 1.0), (0.01, 8.0), (f64::INFINITY, 10.0)]);
        assert_eq!(quantile_bound(&b, 0.5), Some(0.01));
        assert_eq!(quantile_bound(&b, 0.1), Some(0.001));
        assert_eq!(quantile_bound(&b, 0.99), Some(f64::INFINITY));
        let before = vec![(0.001, 1.0), (0.01, 1.0), (f64::INFINITY, 1.0)];
        let d = bucket_delta(&before, &b);
        assert_eq!(d, vec![(0.001, 0.0), (0.01, 7.0), (f64::INFINITY, 9.0)]);
        assert_eq!(quantile_bound(&d, 0.5), Some(0.01));
        assert_eq!(quantile_bound(&[], 0.5), None);
    }
}

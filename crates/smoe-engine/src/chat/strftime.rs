//! Dates for templates: `strftime_now`, and the C-`strftime` subset it formats with.

/// `strftime_now(fmt)`, used by e.g. Llama 3 templates for "Today Date".
/// Always UTC: we carry no time-zone database.
pub(super) fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    format_time(secs, &fmt)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A C-`strftime` subset over a Unix time, UTC. Supports %Y %y %m %d %e %H
/// %I %M %S %p %B %b %A %a %j %% and glibc's `%-d`-style unpadded forms;
/// unknown directives are copied through.
fn format_time(secs: i64, fmt: &str) -> String {
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (h, mi, s) = (tod / 3600, tod % 3600 / 60, tod % 60);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let wday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let h12 = if h % 12 == 0 { 12 } else { h % 12 };

    let mut out = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |v: i64, w: usize| {
            if unpadded {
                v.to_string()
            } else {
                format!("{v:0w$}")
            }
        };
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&num(y.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(m, 2)),
            Some('d') => out.push_str(&num(d, 2)),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('H') => out.push_str(&num(h, 2)),
            Some('I') => out.push_str(&num(h12, 2)),
            Some('M') => out.push_str(&num(mi, 2)),
            Some('S') => out.push_str(&num(s, 2)),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[wday]),
            Some('a') => out.push_str(&DAYS[wday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::format_time;

    #[test]
    fn strftime_subset() {
        assert_eq!(
            format_time(0, "%Y-%m-%d %H:%M:%S %A %b"),
            "1970-01-01 00:00:00 Thursday Jan"
        );
        // 2024-02-29 13:05:09 UTC, a leap day.
        let t = 1_709_164_800 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(
            format_time(t, "%d %B %Y, %I:%M %p (%a, day %j) %-d/%-m %y %%"),
            "29 February 2024, 01:05 PM (Thu, day 060) 29/2 24 %"
        );
    }
}

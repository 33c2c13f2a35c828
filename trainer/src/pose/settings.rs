//! `key=value` settings read through serde: the value is typed after the field it lands in (its
//! current JSON form), put into the configuration's JSON object, and the whole configuration is
//! deserialised again — so a key is parsed exactly as a stored checkpoint's settings are.

use serde_json::{Map, Number, Value};

use super::config::{closest_key, PoseTrainConfig};
use crate::{Result, TrainerError};

/// Ultralytics' other spellings of a key.
const ALIASES: [(&str, &str); 2] = [("amp", "precision"), ("verbose", "progress")];

/// Groups of the configuration whose members are keys of their own (`box=7.5`).
const GROUPS: [&str; 1] = ["loss_gains"];

/// Optional keys: the words that leave them unset, and what a value must be.
const NULLABLE: [(&str, &str, &str); 3] = [
    ("workers", "auto", "a non-negative integer or auto"),
    ("max_batches", "all", "a positive integer or all"),
    ("resume", "none", "a checkpoint path"),
];

/// What a key means where an older ptl (or habit) suggests otherwise.
fn hint(key: &str) -> &'static str {
    match key {
        "scale" => {
            " (scale is the augmentation's zoom gain, as in Ultralytics; the model size is model=yolo26n-pose.yaml, yolo26s-pose.yaml, …)"
        }
        _ => "",
    }
}

/// Keys that take one of a few words (checked again by `validate` for configurations built in code).
const CHOICES: [(&str, &[&str]); 1] = [("loss_assigner", &["auto", "host", "dense"])];

fn bad(reason: String) -> TrainerError {
    TrainerError::InvalidArgument { what: "override", reason }
}

impl PoseTrainConfig {
    /// Applies one `key=value` setting (Ultralytics spelling). An unknown key is answered with the
    /// nearest known one; a value that does not fit its key names the key and what it takes.
    /// Ranges are [`PoseTrainConfig::validate`]'s.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        // Ultralytics' `amp` is a switch whose meaning depends on the device: kept until the
        // device is known (`resolve_amp`). A precision name after `amp=` is that precision.
        if key == "amp" {
            match value.trim().to_ascii_lowercase().as_str() {
                "true" | "yes" | "on" | "1" => {
                    self.amp = Some(true);
                    return Ok(());
                }
                "false" | "no" | "off" | "0" => {
                    self.amp = Some(false);
                    return Ok(());
                }
                "none" | "null" => {
                    self.amp = None;
                    return Ok(());
                }
                _ => {}
            }
        }
        // AutoBatch: `batch=-1` (60 % of device memory) or a fraction in (0, 1), resolved with
        // the device (`resolve_autobatch`).
        if key == "batch" {
            if let Ok(v) = value.trim().parse::<f64>() {
                if v == -1.0 || (v > 0.0 && v < 1.0) {
                    self.autobatch = Some(if v == -1.0 { 0.60 } else { v });
                    return Ok(());
                }
            }
        }
        let key = ALIASES.iter().find(|(a, _)| *a == key).map_or(key, |(_, k)| *k);
        if !Self::keys().iter().any(|(k, _, _)| *k == key) {
            if let Some(said) = super::foreign_keys::check(key, value) {
                return said.map_err(bad);
            }
            let hint = closest_key(key).map(|k| format!("did you mean `{k}`? ")).unwrap_or_default();
            return Err(bad(format!("unknown key `{key}` ({hint}`ptl cfg` lists every key with its default)")));
        }
        let mut doc = match serde_json::to_value(&*self) {
            Ok(Value::Object(m)) => m,
            _ => return Err(bad(format!("`{key}={value}`: the current settings cannot be written as JSON (a non-finite number?)"))),
        };
        // The type comes from the default's JSON (the current value of an optional key may be null).
        let mut defaults = match serde_json::to_value(PoseTrainConfig::default()) {
            Ok(Value::Object(m)) => m,
            _ => Map::new(),
        };
        let kind = field_mut(&mut defaults, key).map(|v| v.clone()).unwrap_or(Value::Null);
        let nullable = NULLABLE.iter().find(|(k, _, _)| *k == key);
        let (typed, expected) = typed_value(key, value, &kind, nullable).map_err(|e| match e {
            TrainerError::InvalidArgument { what, reason } => TrainerError::InvalidArgument { what, reason: reason + hint(key) },
            other => other,
        })?;
        let slot = field_mut(&mut doc, key).ok_or_else(|| bad(format!("`{key}` is listed but not a setting (a ptl bug)")))?;
        *slot = typed.clone();
        let mut next = deserialize(&doc);
        if next.is_err() && !typed.is_string() && !matches!(typed, Value::Null) {
            // A value that only looked like a number (a path `resume=123`): try it as text.
            *field_mut(&mut doc, key).unwrap_or(&mut Value::Null) = Value::String(value.to_string());
            next = deserialize(&doc).or(next);
        }
        let mut next = next.map_err(|e| {
            bad(match expected {
                Some(what) => format!("`{key}={value}`: expected {what}{}", hint(key)),
                None => format!("`{key}={value}`: {e}"),
            })
        })?;
        // Fields kept out of the settings' JSON; a precision given later than `amp` wins.
        next.inject_loader_panic_at = self.inject_loader_panic_at;
        next.amp = if key == "precision" { None } else { self.amp };
        next.autobatch = if key == "batch" { None } else { self.autobatch };
        if key == "project" || key == "name" {
            next.save_dir = next.project.join(&next.name);
        }
        *self = next;
        Ok(())
    }
}

impl PoseTrainConfig {
    /// Every setting as the `key=value` text [`PoseTrainConfig::set`] reads back: what the run
    /// resolved, in `ptl cfg` order.
    pub fn settings(&self) -> Vec<(String, String)> {
        let mut doc = match serde_json::to_value(self) {
            Ok(Value::Object(m)) => m,
            _ => return Vec::new(),
        };
        Self::keys()
            .iter()
            .filter_map(|(key, _, _)| {
                let text = match field_mut(&mut doc, key)? {
                    Value::String(s) => s.clone(),
                    Value::Null => NULLABLE.iter().find(|(k, _, _)| k == key).map_or("none", |(_, word, _)| *word).to_string(),
                    Value::Array(items) if items.is_empty() => "none".into(),
                    Value::Array(items) => {
                        let cells: Vec<String> = items.iter().map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string)).collect();
                        format!("[{}]", cells.join(","))
                    }
                    other => other.to_string(),
                };
                Some((key.to_string(), text))
            })
            .collect()
    }

    /// Ultralytics' `args.yaml`: one `key: value` line per setting (plain where YAML reads the text
    /// back unchanged, else a double-quoted scalar), readable again as `ptl train args.yaml`.
    pub fn args_yaml(&self) -> String {
        let plain = |v: &str| {
            !v.is_empty()
                && v.chars().all(|c| c.is_ascii_alphanumeric() || "_./+-".contains(c))
                && !v.starts_with(['-', '.'])
                && !["y", "n", "null", "~", "on", "off"].contains(&v.to_ascii_lowercase().as_str())
        };
        self.settings()
            .into_iter()
            .map(|(k, v)| match plain(&v) {
                true => format!("{k}: {v}\n"),
                false => format!("{k}: {}\n", Value::String(v)),
            })
            .collect()
    }
}

fn deserialize(doc: &Map<String, Value>) -> serde_json::Result<PoseTrainConfig> {
    serde_json::from_value(Value::Object(doc.clone()))
}

/// The JSON value of `key`: a top-level field or a member of one of the [`GROUPS`].
fn field_mut<'a>(doc: &'a mut Map<String, Value>, key: &str) -> Option<&'a mut Value> {
    if doc.contains_key(key) {
        return doc.get_mut(key);
    }
    let group = GROUPS.iter().find(|g| doc.get(**g).and_then(Value::as_object).is_some_and(|m| m.contains_key(key)))?;
    doc.get_mut(*group)?.as_object_mut()?.get_mut(key)
}

/// `value` as the JSON the field whose default is `current` takes, and how to describe a fitting value
/// when deserialisation fails (`None`: serde's own message says it better).
fn typed_value(key: &str, value: &str, current: &Value, nullable: Option<&(&str, &str, &str)>) -> Result<(Value, Option<String>)> {
    let v = value.trim();
    if let Some((_, word, what)) = nullable {
        if v.eq_ignore_ascii_case(word) || v.eq_ignore_ascii_case("none") || v.eq_ignore_ascii_case("null") {
            return Ok((Value::Null, None));
        }
        return Ok((scalar(v), Some(what.to_string())));
    }
    if let Some((_, words)) = CHOICES.iter().find(|(k, _)| *k == key) {
        if !words.contains(&v) {
            return Err(bad(format!("`{key}={value}`: expected {}", words.join(", "))));
        }
    }
    let expected = |what: &str| Some(what.to_string());
    Ok(match current {
        Value::Bool(_) => match v.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" => (Value::Bool(true), None),
            "false" | "0" | "no" => (Value::Bool(false), None),
            _ => return Err(bad(format!("`{key}={value}`: expected true or false"))),
        },
        Value::Number(n) => {
            let what = if n.is_u64() {
                "a non-negative integer"
            } else if n.is_i64() {
                "an integer"
            } else {
                "a number"
            };
            let parsed = number(v).ok_or_else(|| bad(format!("`{key}={value}`: expected {what}")))?;
            (Value::Number(parsed), expected(what))
        }
        Value::Array(_) => (list(v), None),
        Value::Object(_) => {
            let parsed = serde_json::from_str::<Value>(v)
                .ok()
                .filter(Value::is_object)
                .ok_or_else(|| bad(format!("`{key}={value}`: expected a JSON object, e.g. {{\"stem\": {{\"warmup_calls\": 2}}}}")))?;
            (parsed, None)
        }
        Value::String(_) | Value::Null => (Value::String(value.to_string()), None),
    })
}

/// An integer or a finite number (`1e-3`, `.5`); `None` for anything else, NaN and ∞ included.
fn number(v: &str) -> Option<Number> {
    if let Ok(u) = v.parse::<u64>() {
        return Some(u.into());
    }
    if let Ok(i) = v.parse::<i64>() {
        return Some(i.into());
    }
    v.parse::<f64>().ok().and_then(Number::from_f64)
}

/// A number when it reads as one, else the text.
fn scalar(v: &str) -> Value {
    number(v).map_or_else(|| Value::String(v.to_string()), Value::Number)
}

/// `[0,3,5]`, `0,3,5`, a single `3`, or `none`/empty for an empty list.
fn list(v: &str) -> Value {
    let inner = v.strip_prefix('[').and_then(|r| r.strip_suffix(']')).unwrap_or(v).trim();
    if inner.is_empty() || inner.eq_ignore_ascii_case("none") {
        return Value::Array(Vec::new());
    }
    if !v.starts_with('[') && !inner.contains(',') {
        return scalar(inner);
    }
    Value::Array(inner.split(',').map(|s| scalar(s.trim().trim_matches(|c| c == '"' || c == '\''))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pose::{ModelSource, Precision};

    fn json(c: &PoseTrainConfig) -> Value {
        serde_json::to_value(c).unwrap()
    }

    /// Every setting written as text (args.yaml's values) and set again gives the same
    /// configuration, with lists of one and several items, unset optional keys, a JSON object and
    /// paths with spaces.
    #[test]
    fn settings_round_trip_through_their_text() {
        let mut c = PoseTrainConfig::default();
        for (k, v) in [
            ("data", "/tmp/my data/set: a.yaml"),
            ("epochs", "7"),
            ("lr0", "0.0123"),
            ("freeze", "[5]"),
            ("replay", "feature,stem"),
            ("replay_config", r#"{"stem": {"warmup_calls": 2}}"#),
            ("workers", "3"),
            ("cos_lr", "true"),
        ] {
            c.set(k, v).unwrap();
        }
        for start in [PoseTrainConfig::default(), c] {
            let mut back = PoseTrainConfig::default();
            for (k, v) in start.settings() {
                back.set(&k, &v).unwrap_or_else(|e| panic!("{k}={v}: {e}"));
            }
            assert_eq!(json(&back), json(&start));
            let yaml = start.args_yaml();
            // `amp` is resolved into `precision`, which is written.
            let keys = PoseTrainConfig::keys();
            let missing: Vec<&str> =
                keys.iter().map(|k| k.0).filter(|k| *k != "amp" && !yaml.lines().any(|l| l.starts_with(&format!("{k}: ")))).collect();
            assert!(missing.is_empty(), "missing {missing:?}");
        }
    }

    #[test]
    fn values_take_their_field_type() {
        assert_eq!(list("[0, 3,5]"), serde_json::json!([0, 3, 5]));
        assert_eq!(list("3"), serde_json::json!(3));
        assert_eq!(list("none"), serde_json::json!([]));
        assert_eq!(number("1e-3"), Number::from_f64(1e-3));
        assert_eq!(number("nan"), None);
        assert_eq!(number("-1"), Some((-1i64).into()));
    }

    /// Every key `ptl cfg` lists takes the default it prints and leaves the settings as they were.
    #[test]
    fn every_listed_default_round_trips() {
        let d = PoseTrainConfig::default();
        for (key, default, _) in PoseTrainConfig::keys() {
            if key == "device" || key == "amp" {
                continue; // `auto` resolves to the machine's device, not to a stored value; amp waits for it.
            }
            let mut c = d.clone();
            c.set(key, &default).unwrap_or_else(|e| panic!("{key}={default}: {e}"));
            assert_eq!(json(&c), json(&d), "{key}={default}");
        }
    }

    /// Values of every kind land in their fields, and the settings survive a JSON round trip (the
    /// checkpoint's copy) unchanged.
    #[test]
    fn settings_reach_their_fields_and_round_trip() {
        let mut c = PoseTrainConfig::default();
        for (k, v) in [
            ("model", "yolo26s-pose.yaml"),
            ("scale", "0.25"),
            ("degrees", "10"),
            ("hsv_h", ".02"),
            ("fliplr", "0"),
            ("mosaic", "0.5"),
            ("box", "5"),
            ("amp", "bf16"),
            ("freeze", "3"),
            ("replay", "feature, stem"),
            ("workers", "2"),
            ("max_batches", "all"),
            ("cos_lr", "yes"),
            ("save_period", "-1"),
            ("project", "out"),
            ("name", "exp"),
            ("lr0", "1e-3"),
        ] {
            c.set(k, v).unwrap_or_else(|e| panic!("{k}={v}: {e}"));
        }
        assert_eq!(ModelSource::parse(&c.model).unwrap().scale().unwrap(), ptl_heads::Scale::S);
        assert_eq!((c.scale, c.degrees, c.hsv_h, c.fliplr, c.mosaic, c.lr0), (0.25, 10.0, 0.02, 0.0, 0.5, 1e-3));
        assert_eq!(c.augment().scale, 0.25);
        assert_eq!((c.loss_gains.box_gain, c.precision), (5.0, Precision::Bf16Mixed));
        assert_eq!((c.freeze.clone(), c.replay.clone()), (vec![0, 1, 2], vec!["feature".to_string(), "stem".to_string()]));
        assert_eq!((c.workers, c.max_batches, c.cos_lr), (Some(2), None, true));
        assert_eq!(c.save_dir, std::path::PathBuf::from("out/exp"));
        c.validate().unwrap();
        let back: PoseTrainConfig = serde_json::from_value(json(&c)).unwrap();
        assert_eq!(json(&back), json(&c));
        c.set("freeze", "0,4").unwrap();
        assert_eq!(c.freeze, vec![0, 4]);
    }

    /// Wrong values name the key and what it takes; an unknown key gets the nearest known one.
    #[test]
    fn errors_name_the_key_and_the_fix() {
        let mut c = PoseTrainConfig::default();
        for (k, v, want) in [
            ("epochs", "abc", "`epochs=abc`: expected a non-negative integer"),
            ("epochs", "1.5", "expected a non-negative integer"),
            ("epochs", "-3", "expected a non-negative integer"),
            ("cos_lr", "maybe", "expected true or false"),
            ("momentum", "nan", "expected a number"),
            ("scale", "s", "the model size is model=yolo26n-pose.yaml"),
            ("workers", "many", "a non-negative integer or auto"),
            ("precision", "fp8", "use 32-true, bf16-mixed or 16-mixed"),
            ("replay_config", "[1]", "expected a JSON object"),
            ("loss_assigner", "gpu", "expected auto, host, dense"),
            ("hsv_hh", "0.1", "did you mean `hsv_h`?"),
            ("degree", "1", "did you mean `degrees`?"),
            ("mosiac", "1", "did you mean `mosaic`?"),
        ] {
            let before = json(&c);
            let e = c.set(k, v).expect_err(k).to_string();
            assert!(e.contains(want), "{k}={v}: {e}");
            assert_eq!(json(&c), before, "{k}={v}: a refused value changes nothing");
        }
        for (k, v, want) in [
            ("model", "yolo26q-pose.yaml", "yolo26n-pose.yaml"),
            ("model", "yolo26n-pose.pt", "ultralytics_pt_to_safetensors.py"),
            ("mixup", "0.2", "does not implement MixUp"),
            ("scale", "1.5", "scale = 1.5 is outside"),
            ("fliplr", "2", "fliplr = 2 is outside"),
        ] {
            let mut c = PoseTrainConfig::default();
            c.set(k, v).unwrap_or_else(|e| panic!("{k}={v} is read, then refused by validate: {e}"));
            let e = c.validate().expect_err(k).to_string();
            assert!(e.contains(want), "{k}={v}: {e}");
        }
    }
}

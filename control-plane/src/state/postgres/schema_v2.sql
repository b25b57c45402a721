-- Issue 16: every configuration version records who applied it. Versions
-- stored before this migration keep empty values (unknown).
ALTER TABLE config_versions ADD COLUMN IF NOT EXISTS applied_by TEXT NOT NULL DEFAULT '';
ALTER TABLE config_versions ADD COLUMN IF NOT EXISTS client_address TEXT NOT NULL DEFAULT '';

-- Issue 16: every configuration version records who applied it. Versions
-- stored before this migration keep empty values (unknown).
ALTER TABLE config_versions ADD COLUMN applied_by TEXT NOT NULL DEFAULT '';
ALTER TABLE config_versions ADD COLUMN client_address TEXT NOT NULL DEFAULT '';

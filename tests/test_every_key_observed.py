"""Bookkeeping for issue 12: every configuration key has a test that observes its effect.

`OBSERVED` maps each key of `NODE_SPECS` + `RUN_SPECS` (diloco_node/config/settings.py, the keys
docs/OPERATIONS.md documents) to the tests that change the key and check a consequence. This file
proves nothing about behaviour itself: it fails when a key is added without a test, or when a
referenced test is renamed or removed. The proof is in the referenced tests. Where a test drives
the component a key configures rather than the key itself, the wiring (key -> component) is named
in the test or in a second entry. Tests under tests/integration/ (the only ones marked
`integration`) start processes and are left out of the fast loop (`-m 'not integration'`); keys
observed only there are listed in `INTEGRATION_ONLY` (empty now).
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import pytest

from diloco_node.config.settings import NODE_SPECS, RUN_SPECS

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

E = "tests/test_key_effects.py::"
TLS = "tests/test_transport_tls.py::"
CLUSTER = "tests/integration/test_daemon_cluster.py::"
OS = "tests/test_outer_schedule.py::"
IO = "tests/test_inner_optimizers.py::"

OBSERVED: dict[str, tuple[str, ...]] = {
    # ---------------------------------------------------------------- [node]
    "node_id": (E + "test_node_id_and_role_are_what_the_daemon_calls_itself_and_how_it_joins",
                "tests/integration/test_launcher.py::test_a_site_behind_a_link_answers_through_it_and_close_leaves_nothing",
                CLUSTER + "test_three_sites_commit_and_agree"),
    "listen": ("tests/integration/test_launcher.py::test_a_site_behind_a_link_answers_through_it_and_close_leaves_nothing",
               TLS + "test_tls_keys_derive_https_and_a_loopback_status_listener"),
    "advertise": (E + "test_advertise_is_the_url_the_site_announces_to_members",
                  "tests/integration/test_launcher.py::test_a_site_behind_a_link_answers_through_it_and_close_leaves_nothing",),
    "source_address": ("tests/test_transport.py::test_the_client_connects_from_its_configured_source_address",
                       E + "test_source_address_reaches_the_peer_client_options"),
    "bootstrap": ("tests/test_join_retry.py::test_a_starting_peer_is_asked_again_with_backoff_until_the_deadline",
                  CLUSTER + "test_fourth_site_joins_mid_run_and_is_merged"),
    "data_dir": (E + "test_data_dir_is_where_the_daemon_keeps_its_state_and_finds_its_identity",
                 CLUSTER + "test_sigterm_then_restart_resumes_at_the_same_index_with_identical_state",),
    "secret_file": (E + "test_secret_file_is_the_run_secret_and_so_the_run_id",
                    CLUSTER + "test_wrong_secret_is_refused_and_changes_nothing"),
    "secret_credential": (E + "test_secret_credential_names_the_systemd_credential_the_secret_is_read_from",),
    "role": (E + "test_node_id_and_role_are_what_the_daemon_calls_itself_and_how_it_joins",
             CLUSTER + "test_witness_votes_and_replicates_without_training",),
    "log_level": (E + "test_log_level_decides_which_records_are_written",),
    "connect_timeout_s": ("tests/test_transport_timeouts.py::test_a_blackholed_connect_is_cut_by_connect_timeout_s",
                          "tests/test_transport_timeouts.py::test_the_node_config_timeouts_become_the_transport_bounds"),
    "read_timeout_s": ("tests/test_transport_timeouts.py::test_a_peer_that_accepts_and_never_answers_is_cut_by_read_timeout_s",
                       "tests/test_transport_timeouts.py::test_the_node_config_timeouts_become_the_transport_bounds"),
    "heartbeat_interval_s": (E + "test_heartbeat_interval_s_is_how_often_the_lease_holder_sends_appends",),
    "lease_timeout_s": (E + "test_lease_timeout_s_is_how_long_a_cut_off_holder_keeps_its_lease",),
    "checkpoint_interval_s": (E + "test_checkpoint_interval_s_is_how_often_the_daemon_checkpoints",
                              CLUSTER + "test_sigkill_coordinator_fails_over_and_restarts_from_checkpoint",),
    "checkpoint_keep": (E + "test_checkpoint_keep_is_how_many_checkpoints_stay_on_disk",),
    "log_retain_entries": (E + "test_log_retain_entries_is_the_tail_kept_below_the_checkpoint",
                           "tests/integration/test_daemon_compaction_cluster.py::test_logs_compact_and_stay_bounded"),
    "eval_interval_commits": ("tests/test_daemon_parts.py::test_the_evaluator_runs_every_n_commits_one_at_a_time_on_a_consistent_state",
                              "tests/test_daemon_parts.py::test_a_witness_or_a_disabled_evaluator_never_evaluates"),
    "eval_batches": (E + "test_eval_batches_is_how_many_windows_each_evaluation_scores",),
    "learner": ("tests/test_synthetic_learner.py::test_the_node_keys_select_the_synthetic_learner_and_bad_values_are_config_errors",
                "tests/integration/test_synthetic_cluster.py::test_two_synthetic_learners_commit_rounds_with_equal_digests"),
    "synthetic_steps_per_s": ("tests/test_synthetic_learner.py::test_the_thread_steps_at_its_rate_and_stops",
                              "tests/integration/test_synthetic_cluster.py::test_two_synthetic_learners_commit_rounds_with_equal_digests"),
    "relay_fanout": ("tests/test_daemon_relays.py::test_relay_fanout_is_validated_and_defaults_off",
                     "tests/integration/test_relayed_commits.py::test_relayed_commits_leave_the_holder_fanout_times_and_agree"),
    # ---------------------------------------------------------------- [node.data]
    "data.source": ("tests/test_data.py::test_text_files_and_globs",
                    "tests/test_data.py::test_stdlib_corpus_loads_with_disjoint_eval_files",
                    "tests/test_documents.py::test_directories_and_globs_read_only_document_files"),
    "data.paths": ("tests/test_data.py::test_text_files_and_globs",),
    "data.tokenizer": ("tests/test_site_data.py::test_tokenized_text_equals_tokenizing_the_whole_file",),
    "data.token_dtype": ("tests/test_token_files.py::test_uint32_ids_above_65536_train_and_eval_through_the_sampler",
                         "tests/test_data.py::test_token_file_is_memory_mapped_and_split_by_position"),
    "data.eval_fraction": (E + "test_data_seed_and_eval_fraction_choose_the_held_out_files",
                           "tests/test_data.py::test_token_file_is_memory_mapped_and_split_by_position"),
    "data.seed": (E + "test_data_seed_and_eval_fraction_choose_the_held_out_files",),
    "data.text_field": ("tests/test_documents.py::test_the_text_field_names_the_field_or_column",),
    "data.eos_token": ("tests/test_documents.py::test_the_end_of_document_token_is_found_or_named",),
    "data.eos_id": ("tests/test_documents.py::test_the_end_of_document_token_is_found_or_named",
                    "tests/test_documents.py::test_token_files_with_an_eos_id_count_their_documents"),
    "data.mix": ("tests/test_documents.py::test_a_mixture_from_the_config_file_with_paths_relative_to_it",
                 "tests/test_documents.py::test_mixture_rows_follow_the_weights_reproducibly"),
    "data.eval": ("tests/test_eval_sets.py::test_eval_sets_from_the_file_and_the_environment",
                  "tests/test_eval_sets.py::test_the_evaluator_scores_each_eval_set_and_no_slice_is_held_out"),
    # ---------------------------------------------------------------- TLS and the operator listener
    "tls_cert_file": (TLS + "test_a_member_cannot_speak_for_another",
                      TLS + "test_tls_keys_derive_https_and_a_loopback_status_listener"),
    "tls_key_file": (TLS + "test_unusable_tls_files_name_the_file",),
    "tls_ca_file": (TLS + "test_bad_certificates_are_refused_at_the_handshake",),
    "tls_crl_file": (TLS + "test_bad_certificates_are_refused_at_the_handshake",),
    "status_listen": (TLS + "test_tls_keys_derive_https_and_a_loopback_status_listener",),
    "status_url": ("tests/test_page.py::test_a_node_advertises_its_operator_url_when_tls_moves_it",
                   "tests/test_page.py::test_a_members_status_url_is_learned_from_its_join_and_passed_on"),
    # ---------------------------------------------------------------- [node.mesh], [node.cluster]
    "mesh.data": ("tests/test_mesh.py::test_axis_sizes_resolve_against_the_device_count",),
    "mesh.fsdp": ("tests/test_mesh.py::test_layout_rule_shards_the_largest_divisible_dimension_and_replicates_small_tensors",
                  "tests/test_mesh.py::test_axis_sizes_resolve_against_the_device_count"),
    "mesh.microbatches": ("tests/test_mesh.py::test_the_global_batch_must_split_over_devices_and_microbatches",),
    "mesh.attention": ("tests/test_site_devices.py::test_the_sites_attention_and_remat_choices_are_what_its_learner_compiles",
                       "tests/test_attention.py::test_model_logits_and_gradients_equal_across_attention_choices"),
    "mesh.remat": ("tests/test_site_devices.py::test_the_sites_attention_and_remat_choices_are_what_its_learner_compiles",
                   "tests/test_attention.py::test_remat_choices_give_equal_losses_and_gradients"),
    "mesh.platform": ("tests/test_site_devices.py::test_a_site_that_expects_a_gpu_and_gets_cpu_jax_refuses_to_start",),
    "mesh.peak_tflops": ("tests/test_learner_figures.py::test_site_flops_report_mfu_only_with_a_known_peak",),
    "tracking.tensorboard_dir": ("tests/test_tracking.py::test_tensorboard_event_files_are_written_under_the_data_dir_and_read_back",
                                 "tests/test_tracking.py::test_tracking_table_from_the_file_and_the_environment_and_errors_name_the_key"),
    "tracking.wandb_project": ("tests/test_tracking.py::test_wandb_gets_the_scheme_at_the_learner_step_offline_under_the_data_dir",
                               "tests/test_tracking.py::test_a_missing_extra_is_a_config_error_saying_what_to_install"),
    "tracking.wandb_mode": ("tests/test_tracking.py::test_wandb_gets_the_scheme_at_the_learner_step_offline_under_the_data_dir",
                            "tests/test_tracking.py::test_tracking_table_from_the_file_and_the_environment_and_errors_name_the_key"),
    "tracking.wandb_entity": ("tests/test_tracking.py::test_wandb_gets_the_scheme_at_the_learner_step_offline_under_the_data_dir",
                              "tests/test_tracking.py::test_tracking_table_from_the_file_and_the_environment_and_errors_name_the_key"),
    "tracking.run_name": ("tests/test_tracking.py::test_wandb_gets_the_scheme_at_the_learner_step_offline_under_the_data_dir",
                          "tests/test_tracking.py::test_tracking_table_from_the_file_and_the_environment_and_errors_name_the_key"),
    "cluster.coordinator": ("tests/test_cluster.py::test_a_one_host_site_initialises_no_cluster",
                            "tests/integration/test_site_cluster.py::test_diloco_node_run_on_two_hosts_is_one_site_whose_process_0_is_the_daemon"),
    "cluster.num_processes": (E + "test_cluster_keys_are_what_the_site_joins_its_jax_cluster_with",
                              E + "test_cluster_heartbeat_timeout_and_num_processes_decide_when_and_whom_a_stalled_step_blames",
                              "tests/integration/test_site_cluster.py::test_diloco_node_run_on_two_hosts_is_one_site_whose_process_0_is_the_daemon",),
    "cluster.process_id": (E + "test_cluster_keys_are_what_the_site_joins_its_jax_cluster_with",
                           E + "test_cluster_process_id_above_0_is_a_follower_host_that_reads_no_secret",
                           "tests/integration/test_site_cluster.py::test_diloco_node_run_on_two_hosts_is_one_site_whose_process_0_is_the_daemon",),
    "cluster.heartbeat_timeout_s": (E + "test_cluster_keys_are_what_the_site_joins_its_jax_cluster_with",
                                    E + "test_cluster_heartbeat_timeout_and_num_processes_decide_when_and_whom_a_stalled_step_blames",
                                    "tests/integration/test_site_host_loss.py::test_a_killed_follower_takes_the_site_down_and_a_restart_resumes_it_from_its_checkpoint",),
    # ---------------------------------------------------------------- [run.model], [run.data]
    "run.model.factory": (E + "test_model_factory_vocab_size_and_seq_len_shape_the_model",
                          "tests/test_factory.py::test_a_users_factory_trains_with_its_own_loss_and_embeddings"),
    "run.model.vocab_size": (E + "test_model_factory_vocab_size_and_seq_len_shape_the_model",
                             "tests/test_token_files.py::test_uint32_ids_above_65536_train_and_eval_through_the_sampler"),
    "run.model.seq_len": (E + "test_model_factory_vocab_size_and_seq_len_shape_the_model",),
    "run.model.init_from": ("tests/test_hf_llama.py::test_the_founder_seals_the_imported_shape_and_digest_and_its_state_is_the_import",
                            "tests/test_hf_llama.py::test_a_founding_learner_starts_from_the_import",
                            "tests/test_hf_llama.py::test_init_from_is_a_run_model_key_and_absent_from_manifests_without_it"),
    "run.model.init_sha256": ("tests/test_hf_llama.py::test_init_from_keys_that_contradict_config_json_are_refused_naming_both",
                              "tests/test_hf_llama.py::test_other_weights_in_the_directory_are_refused_and_an_absent_directory_is_a_warning"),
    "run.data.tokenizer_sha256": ("tests/test_site_data.py::test_the_tokenizer_is_sealed_by_the_founder_and_checked_at_every_site",),
    # ---------------------------------------------------------------- [run.inner]
    "run.inner.batch_size": ("tests/test_mesh.py::test_the_global_batch_must_split_over_devices_and_microbatches",
                             E + "test_eval_batches_is_how_many_windows_each_evaluation_scores"),
    "run.inner.lr_peak": ("tests/test_inner.py::test_schedule_warms_up_then_decays_to_the_final_fraction",),
    "run.inner.lr_final_fraction": ("tests/test_inner.py::test_schedule_warms_up_then_decays_to_the_final_fraction",),
    "run.inner.warmup_steps": ("tests/test_inner.py::test_schedule_warms_up_then_decays_to_the_final_fraction",),
    "run.inner.total_steps": ("tests/test_inner.py::test_schedule_warms_up_then_decays_to_the_final_fraction",
                              IO + "test_an_explicit_total_steps_wins_and_an_unbounded_run_keeps_the_fallbacks",
                              IO + "test_the_daemons_learner_runs_the_resolved_schedule"),
    "run.inner.optimizer": (IO + "test_muon_takes_the_hidden_matrices_and_adamw_the_embeddings_head_norms_and_vectors",
                            IO + "test_the_muon_keys_change_the_matrices_update"),
    "run.inner.schedule": (IO + "test_wsd_warms_up_holds_the_peak_then_decays_linearly_over_its_last_fraction",
                           IO + "test_the_daemons_learner_runs_the_resolved_schedule"),
    "run.inner.decay_fraction": (IO + "test_wsd_warms_up_holds_the_peak_then_decays_linearly_over_its_last_fraction",),
    "run.inner.horizon_learners": (IO + "test_the_horizon_follows_stop_steps_and_tokens_shared_by_the_learners",),
    "run.inner.muon_lr_peak": (IO + "test_the_muon_keys_change_the_matrices_update",),
    "run.inner.muon_momentum": (IO + "test_the_muon_keys_change_the_matrices_update",),
    "run.inner.muon_weight_decay": (IO + "test_the_muon_keys_change_the_matrices_update",),
    "run.inner.weight_decay": (E + "test_inner_optimizer_keys_change_the_update",
                               E + "test_weight_decay_applies_to_matrices_only"),
    "run.inner.b1": (E + "test_inner_optimizer_keys_change_the_update",),
    "run.inner.b2": (E + "test_inner_optimizer_keys_change_the_update",),
    "run.inner.grad_clip_norm": (E + "test_inner_optimizer_keys_change_the_update",),
    # ---------------------------------------------------------------- [run.outer]
    "run.outer.lr": (E + "test_outer_lr_and_momentum_change_the_global_step",
                     "tests/test_global_state.py::test_apply_outer_gradient_is_a_nesterov_step_on_one_fragment"),
    "run.outer.momentum": (E + "test_outer_lr_and_momentum_change_the_global_step",
                           "tests/test_merge.py::test_nesterov_first_step_and_momentum"),
    "run.outer.momentum_warmup_rounds": (OS + "test_momentum_warmup_ramps_from_zero_to_the_set_momentum",
                                         OS + "test_each_rounds_step_is_the_nesterov_step_with_that_rounds_values"),
    "run.outer.momentum_decay_rounds": (OS + "test_momentum_decay_reaches_momentum_final_at_the_horizon_and_keeps_it",
                                        OS + "test_each_rounds_step_is_the_nesterov_step_with_that_rounds_values"),
    "run.outer.momentum_final": (OS + "test_momentum_decay_reaches_momentum_final_at_the_horizon_and_keeps_it",
                                 OS + "test_each_rounds_step_is_the_nesterov_step_with_that_rounds_values"),
    "run.outer.lr_schedule": (OS + "test_linear_and_cosine_lr_reach_the_final_fraction_at_the_horizon_and_stay_there",
                              OS + "test_a_late_decay_holds_the_lr_then_cuts_it",
                              OS + "test_each_rounds_step_is_the_nesterov_step_with_that_rounds_values"),
    "run.outer.lr_final_fraction": (OS + "test_linear_and_cosine_lr_reach_the_final_fraction_at_the_horizon_and_stay_there",
                                    OS + "test_each_rounds_step_is_the_nesterov_step_with_that_rounds_values"),
    "run.outer.lr_decay_start": (OS + "test_a_late_decay_holds_the_lr_then_cuts_it",),
    "run.outer.horizon_rounds": (OS + "test_the_horizon_is_the_runs_rounds_unless_set_and_moves_with_the_run",
                                 OS + "test_a_schedule_that_needs_the_horizon_is_refused_without_one",
                                 OS + "test_the_keys_are_node_config_keys_with_environment_variables"),
    # ---------------------------------------------------------------- [run.sync]
    "run.sync.fragments": ("tests/test_fragments.py::test_single_fragment_holds_everything",
                           "tests/test_fragments.py::test_offsets_are_distinct_and_spread_evenly"),
    "run.sync.period": ("tests/test_fragments.py::test_offsets_are_distinct_and_spread_evenly",
                        "tests/test_fragments.py::test_p_equal_h_syncs_one_fragment_every_step"),
    "run.sync.overlap": ("tests/test_quorum.py::test_policy_from_the_run_manifest",
                         "tests/test_quorum.py::test_grace_window_formula"),
    "run.sync.min_quorum": ("tests/test_quorum.py::test_policy_from_the_run_manifest",
                            "tests/test_quorum.py::test_decide_round"),
    "run.sync.grace_gamma": ("tests/test_quorum.py::test_policy_from_the_run_manifest",
                             "tests/test_quorum.py::test_grace_window_formula"),
    "run.sync.grace_cap_s": ("tests/test_quorum.py::test_policy_from_the_run_manifest",
                             "tests/test_quorum.py::test_grace_window_formula"),
    "run.sync.codec_up": (E + "test_codec_up_is_the_codec_a_learner_streams_its_contribution_in",),
    "run.sync.codec_down": ("tests/test_fragments.py::test_fragments_too_big_for_a_commit_are_refused_before_training",
                            E + "test_codec_down_sizes_the_commit_checked_against_the_wire"),
    "run.sync.merge": (E + "test_sync_merge_and_weighting_change_the_merged_outer_gradient",
                       "tests/test_merge.py::test_embeddings_use_the_weighted_mean_and_other_tensors_rda"),
    "run.sync.weighting": (E + "test_sync_merge_and_weighting_change_the_merged_outer_gradient",
                           "tests/test_merge.py::test_embeddings_use_the_weighted_mean_and_other_tensors_rda"),
    "run.sync.contribution_norm": ("tests/test_contribution_norm.py::test_the_syncer_merges_with_the_manifests_contribution_norm",
                                   "tests/test_contribution_norm.py::test_the_merge_scales_each_outer_gradient_to_the_median_norm_first"),
    "run.sync.apply": ("tests/test_apply.py::test_the_rule_comes_from_the_run_manifest",
                       "tests/test_apply.py::test_mix_blends_local_and_merged_when_our_work_is_in",
                       "tests/test_apply.py::test_eager_takes_the_progress_made_while_the_round_was_in_flight_on_top_of_the_merge"),
    "run.sync.mix_alpha": ("tests/test_apply.py::test_the_rule_comes_from_the_run_manifest",
                           "tests/test_apply.py::test_mix_blends_local_and_merged_when_our_work_is_in"),
    "run.sync.error_feedback": ("tests/test_error_feedback.py::test_the_runner_sends_the_remainder_with_error_feedback_on_and_its_decay_matters",
                                "tests/test_error_feedback.py::test_the_error_feedback_keys_are_checked_and_only_a_sparse_codec_uses_them",
                                "tests/test_error_feedback.py::test_int4_both_ways_with_error_feedback_on_is_the_very_run_with_it_off"),
    "run.sync.error_feedback_decay": ("tests/test_error_feedback.py::test_the_runner_sends_the_remainder_with_error_feedback_on_and_its_decay_matters",
                                      "tests/test_error_feedback.py::test_the_learner_thread_sends_x_keeps_x_minus_q_and_keeps_it_through_a_checkpoint",
                                      "tests/test_error_feedback.py::test_the_error_feedback_keys_are_checked_and_only_a_sparse_codec_uses_them"),
    "run.sync.keep_unmerged": ("tests/test_apply.py::test_the_rule_comes_from_the_run_manifest",
                               "tests/test_apply.py::test_keep_unmerged_takes_a_merge_without_our_unsent_work_on_top_of_it_and_keeps_the_counters",
                               "tests/test_apply.py::test_by_default_a_merge_without_us_overwrites_our_unsent_work"),
    "run.sync.max_tokens_per_step": ("tests/test_run_stop.py::test_the_syncer_commits_the_accepted_work_capped_as_the_weights_are",
                                     "tests/test_merge.py::test_caps_from_the_run_manifest",
                                     "tests/test_merge.py::test_capped_claims_are_accepted_at_reduced_weight_and_reported"),
    "run.sync.max_steps_per_contribution": ("tests/test_merge.py::test_caps_from_the_run_manifest",
                                            "tests/test_run_stop.py::test_the_syncer_commits_the_accepted_work_capped_as_the_weights_are"),
    # ---------------------------------------------------------------- [run.stop], run.seed
    "run.stop.tokens": ("tests/test_run_stop.py::test_the_run_is_complete_when_every_fragment_has_merged_the_limit_and_no_later_commit_applies",
                        IO + "test_the_horizon_follows_stop_steps_and_tokens_shared_by_the_learners"),
    "run.stop.steps": ("tests/test_run_stop.py::test_steps_limit_and_no_limit",
                       IO + "test_the_horizon_follows_stop_steps_and_tokens_shared_by_the_learners"),
    "run.stop.wall_s": ("tests/test_run_stop.py::test_wall_time_completes_at_the_first_commit_planned_past_it_and_travels_with_the_state",),
    "run.seed": (E + "test_run_seed_is_the_initial_model",),
}

# Keys whose effect only a multi-process (integration) test observes: none any more (the daemon's
# own wiring of the last six is driven in-process by tests/test_key_effects.py).
INTEGRATION_ONLY: frozenset[str] = frozenset()


@lru_cache(maxsize=None)
def _test_functions(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text(), filename=path)
    return frozenset(node.name for node in tree.body
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"))


def _is_integration(path: str) -> bool:
    return path.startswith("tests/integration/")  # tests/test_test_layout.py: and nowhere else


def test_every_key_has_an_entry_and_no_entry_is_stale() -> None:
    keys = [spec.key for spec in NODE_SPECS + RUN_SPECS]
    missing = [key for key in keys if key not in OBSERVED]
    assert not missing, f"keys without a test observing their effect (add one, then list it here): {missing}"
    stale = sorted(set(OBSERVED) - set(keys))
    assert not stale, f"entries for keys that no longer exist: {stale}"
    assert all(OBSERVED[key] for key in keys)


@pytest.mark.parametrize("key", sorted(OBSERVED))
def test_every_referenced_test_exists(key: str) -> None:
    for node_id in OBSERVED[key]:
        path, sep, name = node_id.partition("::")
        assert sep and (ROOT / path).is_file(), f"{key}: {node_id}: no such test file"
        assert name in _test_functions(path), f"{key}: {node_id}: no such test function"


def test_integration_only_keys_are_exactly_those_without_a_default_suite_test() -> None:
    only = {key for key, ids in OBSERVED.items() if all(_is_integration(i.partition("::")[0]) for i in ids)}
    assert only == INTEGRATION_ONLY
